"""The model repository on disk: model folders, version folders, and what changed.

:func:`what_to_load` reads the config a load applies and the versions it selects;
:func:`version_files` tells a load which versions' files are unchanged since their
copy was built (so the lifecycle keeps that copy).

Layout as Triton's: ``<repository>/<model>/<version>/<model file>``, version folders
named by positive integers, an optional ``warmup/`` folder for warm-up data. Names
starting with a dot are invisible, so a writer can stage ``.2.tmp`` and rename it
to ``2`` once it is complete (an atomic step on one file system).

:class:`RepositoryPoller` decides, poll by poll, which models to (re)load or unload
in ``poll`` mode. It never acts on a model whose files are still changing: a
change is applied only once two consecutive polls saw the same files, sizes and
modification times, and no version folder is empty.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from appliance import names
from appliance.config.model_config import ModelConfig, parse_model_config
from appliance.config.reader import CONFIG_FILES, load_model_config, with_labels
from appliance.errors import ApplianceError, invalid, not_found

# folders inside a model folder that are not versions
NOT_VERSIONS = {"warmup", "initial_state"}

# (relative path, size, mtime_ns) of every visible file in a model folder
Fingerprint = tuple[tuple[str, int, int], ...]


def load_order(repository: Path, models: list[str], allow_links: bool) -> list[str]:
    """``models`` with every ensemble after the models its steps name, ensembles of
    ensembles included (a cycle or an unreadable config is reported when it loads)."""
    ranks: dict[str, int] = {}

    def rank(name: str) -> int:
        if name in ranks:  # known, or being ranked (a cycle): no further
            return ranks[name]
        ranks[name] = 0
        try:
            config = load_model_config(names.model_dir(repository, name, allow_links))
        except ApplianceError:
            return 0
        if config.platform == "ensemble":
            steps = {s.model_name for s in config.ensemble_steps}
            ranks[name] = 1 + max((rank(s) for s in steps), default=0)
        return ranks[name]

    return sorted(models, key=rank)


def model_names(repository: Path) -> list[str]:
    """The model folders: those whose name is a valid model name (see
    :mod:`appliance.names`; hidden and oddly named folders are not models)."""
    return sorted(p.name for p in repository.iterdir() if p.is_dir() and names.is_name(p.name))


def model_folder_hint(repository: Path) -> str:
    """A hint when ``repository`` looks like one model's folder, not a repository of
    them (a model config in it, or version folders 1/, 2/ ...), else ""."""
    try:
        configs = [name for name in CONFIG_FILES if (repository / name).is_file()]
        versions = sorted(
            p.name
            for p in repository.iterdir()
            if p.is_dir() and names.version_folder(p.name) is not None
        )
    except OSError:
        return ""
    if not configs and not versions:
        return ""
    what = configs[0] if configs else f"the version folder {versions[0]}/"
    return (
        f"{repository} looks like a model folder (it holds {what}), not a model repository: "
        f"point --model-repository (model_repository) at the folder that holds the model "
        f"folders, such as {repository.parent}"
    )


def version_dirs(model_dir: Path) -> list[int]:
    """The model's version numbers; INVALID_ARG naming a folder that is not a number."""
    versions = []
    for p in sorted(model_dir.iterdir()):
        if not p.is_dir() or p.name.startswith(".") or p.name in NOT_VERSIONS:
            continue
        version = names.version_folder(p.name)
        if version is None:
            raise invalid(
                f"model '{model_dir.name}': version folder '{p.name}' is not a version number "
                f"(version folders are named 1, 2, ...; stage unfinished ones under a name "
                f"starting with '.')"
            )
        versions.append(version)
    return sorted(versions)


def what_to_load(
    repository: Path, name: str, override: dict[str, Any] | None, allow_links: bool
) -> tuple[ModelConfig, list[int]]:
    """The config a load of ``name`` applies (``override``, the load request's config,
    or the model folder's file) and the versions its policy selects, every folder
    confined to ``repository`` unless ``allow_links``."""
    model_dir = repository / name
    names.confine(repository, model_dir, allow_links, f"the folder of model '{name}'")
    if override is not None:
        where = "load request parameter 'config'"
        config = with_labels(parse_model_config(override, name, where), model_dir)
    else:
        config = load_model_config(model_dir)
    wanted = config.version_policy.select(version_dirs(model_dir))
    if not wanted:
        raise not_found(
            f"model '{name}' has no version folder that its version policy serves in {model_dir}"
        )
    for v in wanted:
        names.confine(repository, model_dir / str(v), allow_links, f"model '{name}' version {v}")
    return config, wanted


def fingerprint(model_dir: Path) -> Fingerprint | None:
    """What the model folder holds now; None while a version folder is empty (being
    written) or the folder vanished."""
    out = []
    try:
        for root, dirs, files in os.walk(model_dir):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            rel = os.path.relpath(root, model_dir)
            visible = [f for f in files if not f.startswith(".")]
            if rel != "." and os.sep not in rel and rel.isdigit() and not visible and not dirs:
                return None  # a version folder with no file yet
            for name in visible:
                st = os.stat(os.path.join(root, name))
                out.append((os.path.normpath(os.path.join(rel, name)), st.st_size, st.st_mtime_ns))
    except OSError:
        return None
    return tuple(sorted(out))


def version_files(model_dir: Path, versions: list[int]) -> dict[int, Fingerprint | None]:
    """Per version, what building it reads besides the config: its version folder and
    the model folder's shared files (warm-up data, initial states, labels), config
    files aside (a load compares the parsed config instead). None where the folder
    cannot be read or a version folder is still empty. Blocking: run it on a worker
    thread."""
    whole = fingerprint(model_dir)
    if whole is None:
        return dict.fromkeys(versions)
    owned: dict[str, list[tuple[str, int, int]]] = {}
    for entry in whole:
        first, sep, _ = entry[0].partition(os.sep)
        if not sep and first in CONFIG_FILES:
            continue
        owner = first if sep and first.isdigit() else ""
        owned.setdefault(owner, []).append(entry)
    shared = owned.get("", [])
    return {v: tuple(sorted([*owned.get(str(v), []), *shared])) for v in versions}


def snapshot(repository: Path) -> dict[str, Fingerprint | None]:
    """Every model folder's fingerprint (blocking: run it on a worker thread)."""
    try:
        names = model_names(repository)
    except OSError:
        return {}
    return {name: fingerprint(repository / name) for name in names}


class RepositoryPoller:
    """Which models to load or unload, given successive snapshots of the repository.

    Pure bookkeeping, no I/O: feed each poll's snapshot to :meth:`changes`, and
    report each model it asked for with :meth:`applied` once acted on.
    """

    def __init__(self, baseline: Mapping[str, Fingerprint | None]) -> None:
        self._applied: dict[str, Fingerprint | None] = dict(baseline)
        self._previous: dict[str, Fingerprint | None] = dict(baseline)

    def changes(self, current: Mapping[str, Fingerprint | None]) -> tuple[list[str], list[str]]:
        """(models to load or reload, models to unload) for this poll."""
        previous, self._previous = self._previous, dict(current)
        load = [
            name
            for name, fp in current.items()
            if fp is not None
            and name in previous
            and previous[name] == fp  # unchanged since the last poll: not being written
            and self._applied.get(name, ()) != fp
        ]
        # gone in two polls running: a folder renamed away and back in between is kept
        unload = [n for n in self._applied if n not in current and n not in previous]
        return sorted(load), sorted(unload)

    def applied(self, name: str, fp: Fingerprint | None) -> None:
        self._applied[name] = fp

    def forget(self, name: str) -> None:
        self._applied.pop(name, None)
