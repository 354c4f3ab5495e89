"""The model repository on disk, as the agent changes it.

What is on disk is what is committed: each model the agent manages gets a
``config.pbtxt`` whose ``version_policy`` names exactly the committed version, so
a server that (re)starts at any moment loads the committed version and never a
candidate under test (boot-loop protection). Candidates are loaded by the agent
with a config override naming both versions; see :mod:`appliance.ota.agent`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from appliance.config.model_config import ModelConfig
from appliance.config.reader import CONFIG_FILES, load_model_config
from appliance.config.triton_config import dict_to_pbtxt, to_triton_json
from appliance.core.repository import version_dirs
from appliance.errors import ApplianceError
from appliance.ota import OtaError
from appliance.ota.state import fsync_dir


def with_versions(config: dict[str, Any], versions: list[int]) -> dict[str, Any]:
    return {**config, "version_policy": {"specific": {"versions": sorted(set(versions))}}}


def on_disk(repository: Path, model: str) -> dict[str, Any] | None:
    """The model's current config in Triton JSON form, or None if the model is absent."""
    config = read_disk_config(repository, model)
    return None if config is None else to_triton_json(config)


def read_disk_config(repository: Path, model: str) -> ModelConfig | None:
    folder = repository / model
    if not folder.is_dir():
        return None
    try:
        return load_model_config(folder)
    except ApplianceError as exc:
        raise OtaError(f"model '{model}': its config on disk is invalid: {exc}") from None


def pinned(repository: Path, model: str) -> tuple[int, ...] | None:
    """The versions the config on disk names (None: absent, or not pinned by version)."""
    config = read_disk_config(repository, model)
    if config is None or config.version_policy.kind != "specific":
        return None
    return tuple(sorted(config.version_policy.versions))


def version_files(repository: Path, model: str, version: int) -> list[str]:
    folder = repository / model / str(version)
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def disk_versions(repository: Path, model: str) -> list[int]:
    folder = repository / model
    try:
        return version_dirs(folder) if folder.is_dir() else []
    except ApplianceError:
        return []


def write_config(repository: Path, model: str, config: dict[str, Any]) -> None:
    """Replace the model's config file (atomically) with ``config`` as config.pbtxt."""
    folder = repository / model
    folder.mkdir(parents=True, exist_ok=True)
    try:
        text = dict_to_pbtxt(config)
    except ApplianceError as exc:
        raise OtaError(f"model '{model}': cannot write its config: {exc}") from None
    tmp = folder / ".config.pbtxt.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    for name in CONFIG_FILES:
        if name != "config.pbtxt":
            (folder / name).unlink(missing_ok=True)
    os.replace(tmp, folder / "config.pbtxt")
    fsync_dir(folder)


def place(staging: Path, repository: Path, model: str, version: int) -> None:
    """Rename the staged files into ``<repository>/<model>/<version>`` (one rename)."""
    dest = repository / model / str(version)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(staging, dest)
    fsync_dir(dest.parent)


def remove_version(repository: Path, model: str, version: int) -> None:
    shutil.rmtree(repository / model / str(version), ignore_errors=True)


def remove_model(repository: Path, model: str) -> None:
    shutil.rmtree(repository / model, ignore_errors=True)


def staging_dir(repository: Path, model: str, version: int) -> Path:
    """Under a hidden (dot) folder of the repository, on the same file system as the
    destination (so placing it is one rename); the server never sees it."""
    return repository / ".ota-staging" / f"{model}-{version}"


def write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_json(path: Path) -> dict[str, Any]:
    try:
        doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OtaError(f"cannot read the staged config {path}: {exc}") from None
    return doc
