"""Offline updates for sites with no network: one file, verified as online.

``appliance fleet export REPO -o FILE [--target PATH]...`` writes a tar of the
repository's metadata as devices fetch it (every ``N.root.json``,
``timestamp.json``, the snapshot and targets versions it names) and the files of
the chosen targets (default: every current target), under their consistent-snapshot
names. ``appliance ota import FILE`` extracts it into ``<state_dir>/import/``
(regular files only, safe names, bounded sizes), serves that folder on 127.0.0.1
for the duration of the import and runs the agent's own cycle against it
(:class:`appliance.ota.agent.Agent` with that ``source``): ngclient starts from the device's
pinned root exactly as online, so tampered, stale (older than what the device has
seen), expired or unsigned metadata is refused by TUF, a bundle whose bytes differ
from the signed target by the download's check, and a bundle for another platform
or Python, or an older version, is not taken. Models and software take the same
install path as online; maintenance windows do not apply (someone is at the device).
"""

from __future__ import annotations

import dataclasses
import http.server
import io
import json
import shutil
import tarfile
import threading
from functools import partial
from pathlib import Path
from typing import Any

from tuf.api.metadata import Metadata, Targets

from appliance.ota import OtaError, bundle
from appliance.ota.config import OtaConfig
from appliance.ota.manifest import safe_path

MAX_METADATA_BYTES = 64 << 20
MAX_CYCLES = 20  # cycles an import runs at most (a job takes a few)


def export(repo: Path, out: Path, paths: tuple[str, ...] = ()) -> list[str]:
    """Write the export file; returns the target paths it holds."""
    meta = repo / "metadata"
    try:
        ts = json.loads((meta / "timestamp.json").read_text())
        snap_v = int(ts["signed"]["meta"]["snapshot.json"]["version"])
        snap = json.loads((meta / f"{snap_v}.snapshot.json").read_text())
        targets_v = int(snap["signed"]["meta"]["targets.json"]["version"])
        targets: Metadata[Targets] = Metadata.from_file(str(meta / f"{targets_v}.targets.json"))
    except (OSError, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise OtaError(f"{repo} is not a repository made by appliance fleet init: {exc}") from None
    chosen = paths or tuple(sorted(targets.signed.targets))
    members = sorted(p.name for p in meta.glob("*.root.json"))
    members += ["timestamp.json", f"{snap_v}.snapshot.json", f"{targets_v}.targets.json"]
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in members:
            tar.add(meta / name, f"metadata/{name}", filter=_plain)
        for path in chosen:
            target = targets.signed.targets.get(path)
            if target is None:
                raise OtaError(f"{path} is not a current target of {repo}")
            folder, _, name = path.rpartition("/")
            stored = f"{folder}/{target.hashes['sha256']}.{name}"
            tar.add(repo / "targets" / stored, f"targets/{stored}", filter=_plain)
    return list(chosen)


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
    return info


def unpack(file: Path, dest: Path, max_bytes: int) -> None:
    """Extract the export file into ``dest`` (made afresh): only regular files named
    ``metadata/<file>.json`` or ``targets/<dir>/<file>``, at most ``max_bytes`` of
    targets and :data:`MAX_METADATA_BYTES` of metadata."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    sizes = {"metadata": 0, "targets": 0}
    limits = {"metadata": MAX_METADATA_BYTES, "targets": max_bytes}
    try:
        with (
            open(file, "rb") as raw,
            tarfile.open(fileobj=raw, mode="r|", tarinfo=bundle._BoundedInfo) as tar,
        ):
            for info in tar:
                name = bundle._check_member(info)
                parts = name.split("/")
                kind = parts[0]
                if not ((kind == "metadata" and len(parts) == 2 and name.endswith(".json"))
                        or (kind == "targets" and len(parts) == 3)):  # fmt: skip
                    raise OtaError(f"{file}: member {name!r} is neither metadata nor a target")
                sizes[kind] += info.size
                if sizes[kind] > limits[kind]:
                    raise OtaError(f"{file}: more than {limits[kind]} bytes of {kind}")
                reader = tar.extractfile(info)
                out = dest / safe_path(name)
                out.parent.mkdir(parents=True, exist_ok=True)
                with open(out, "xb") as f:
                    shutil.copyfileobj(reader or io.BytesIO(), f, 1 << 20)
    except FileExistsError:
        raise OtaError(f"{file}: a member appears twice") from None
    except (tarfile.TarError, EOFError) as exc:
        raise OtaError(f"{file} is not an export file (appliance fleet export): {exc}") from None
    except bundle._HeaderTooLarge as exc:
        raise OtaError(f"{file} refused: {exc}") from None


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def import_file(cfg: OtaConfig, file: Path) -> tuple[bool, list[dict[str, Any]]]:
    """Run the agent against the export file until nothing is left to do; (success,
    the history entries and software results the import added)."""
    from appliance.ota import abinstall
    from appliance.ota.agent import Agent

    folder = cfg.state_dir / "import"
    unpack(file, folder, cfg.max_bundle_bytes)
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), partial(_Quiet, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    local = dataclasses.replace(
        cfg, source=f"http://127.0.0.1:{server.server_address[1]}/", maintenance_windows=()
    )
    agent = Agent(local)
    before = len(agent.state.history)
    software_before = abinstall.Layout(cfg).load().get("last")
    ok = True
    try:
        for _ in range(MAX_CYCLES):
            ok = agent.run_once() and ok
            if agent.state.job is None and not agent.state.retries:
                if not _more(agent):
                    break
            elif agent.state.retries:
                ok = False
                break
    finally:
        agent.close()
        server.shutdown()
        server.server_close()
        shutil.rmtree(folder, ignore_errors=True)
    done = agent.state.history[before:]
    software_after = abinstall.Layout(cfg).load().get("last")
    if software_after and software_after != software_before:
        done = [*done, {"software": software_after}]
    if not ok and agent.state.last_error:
        done = [*done, {"error": agent.state.last_error}]
    return ok, done


def _more(agent: Any) -> bool:
    """Whether another cycle would take another job (a second model in the file)."""
    from appliance.ota import check

    try:
        return check.newest_offer(agent.cfg, agent.state) is not None
    except OtaError:
        return False
