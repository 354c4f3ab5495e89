"""The check step: refresh the TUF metadata and pick the update this device takes.

ngclient does the trust work (signatures and thresholds, version numbers never
going back, expiry, snapshot consistency, root rotation). Every refresh starts
from the configured ``trusted_root`` (python-tuf's bootstrap), never from whatever
``root.json`` the state folder holds: ngclient walks its cached root history from
the pinned root and refuses a local root that does not chain from it. This module
reads the verified targets and applies the rollout rules, the bad-version list and
what this machine can run, both to choose a job (:func:`newest_offer`) and to
confirm, before each phase change, that the fleet still wants it
(:func:`still_wanted`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tuf.api import exceptions as tuf_errors
from tuf.api.metadata import Metadata, TargetFile, Targets, Timestamp
from tuf.ngclient import Updater, Urllib3Fetcher

from appliance.ota import OtaError, Transient, bundle, delta, install
from appliance.ota.config import OtaConfig
from appliance.ota.manifest import version_tuple
from appliance.ota.rollout import Rollout
from appliance.ota.server_api import ServerApi
from appliance.ota.state import AgentState, Job
from appliance.version import __version__


@dataclass(frozen=True, slots=True)
class Offer:
    model: str
    version: int
    target: TargetFile
    memory_bytes: int
    unpacked_bytes: int  # the files' size once installed (0: the target does not say)


@dataclass(frozen=True, slots=True)
class Fresh:
    """Metadata ngclient has just verified."""

    targets: Metadata[Targets]
    timestamp_expires: datetime


def updater(cfg: OtaConfig) -> Updater:
    """An ngclient Updater over the agent's metadata folder, bootstrapped from the
    pinned root every time (python-tuf's advice)."""
    meta_dir = cfg.state_dir / "metadata"
    meta_dir.mkdir(parents=True, exist_ok=True)
    return Updater(
        str(meta_dir),
        cfg.source + "metadata/",
        str(cfg.state_dir / "downloads"),
        cfg.source + "targets/",
        # (typed int, used as a float by urllib3: sub-second timeouts work)
        fetcher=Urllib3Fetcher(socket_timeout=cfg.metadata_timeout_s),  # type: ignore[arg-type]
        bootstrap=cfg.trusted_root.read_bytes(),
    )


def _reason(exc: BaseException) -> str:
    """An exception's message, or its cause's, or at least its type's name (ngclient's
    SlowRetrievalError and some DownloadErrors carry no message of their own)."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen).strip()
        if text:
            return text if seen is exc else f"{type(exc).__name__}: {text}"
        seen = seen.__cause__ or seen.__context__
    return type(exc).__name__


def refresh(cfg: OtaConfig) -> Fresh:
    """Refresh through ngclient. Transient when the repository cannot be reached,
    OtaError saying why TUF refused it."""
    try:
        updater(cfg).refresh()
        # written by ngclient only after it verified them
        meta_dir = cfg.state_dir / "metadata"
        targets: Metadata[Targets] = Metadata.from_file(str(meta_dir / "targets.json"))
        ts: Metadata[Timestamp] = Metadata.from_file(str(meta_dir / "timestamp.json"))
        return Fresh(targets, ts.signed.expires)
    except tuf_errors.RepositoryError as exc:
        raise OtaError(
            f"TUF refused the repository metadata ({type(exc).__name__}): {_reason(exc)}"
        ) from None
    except tuf_errors.DownloadError as exc:
        raise Transient(f"cannot reach the update repository: {_reason(exc)}") from None
    except OSError as exc:
        raise Transient(f"cannot read the pinned root or metadata: {exc}") from None


def current(cfg: OtaConfig, state: AgentState, model: str) -> int:
    """The committed version: the agent's record, else the newest folder on disk (a
    model installed before the agent ran). During a job, the job's own record."""
    if state.job is not None and state.job.model == model:
        return state.job.previous
    ms = state.models.get(model)
    if ms is not None and ms.current:
        return ms.current
    on_disk = install.disk_versions(cfg.model_repository, model)
    return max(on_disk) if on_disk else 0


def pins(cfg: OtaConfig, targets: Metadata[Targets]) -> dict[str, int]:
    """The version of each model this device is pinned to (``fleet pin``)."""
    out: dict[str, int] = {}
    for target in targets.signed.targets.values():
        info = _info(target)
        if info is None or info.get("kind") == "software":
            continue
        try:
            rollout = Rollout.from_json(info.get("rollout", {}))
            if cfg.device_id in rollout.pinned:
                out[str(info["name"])] = int(info["version"])
        except (KeyError, TypeError, ValueError, OtaError):
            continue
    return out


def applies(
    cfg: OtaConfig, state: AgentState, info: dict[str, Any], pinned: dict[str, int] | None = None
) -> tuple[str, int] | None:
    """(model, version) when this device should install the bundle, else None. A
    device pinned to a version of the model (``pinned``) takes that one only; a
    version it marked bad is taken again once the fleet raised its ``retry``."""
    try:
        model, version = str(info["name"]), int(info["version"])
        rollout = Rollout.from_json(info.get("rollout", {}))
    except (KeyError, TypeError, ValueError, OtaError):
        return None
    if pinned and model in pinned and pinned[model] != version:
        return None
    if not rollout.includes(model, cfg.device_id, cfg.channel, cfg.groups):
        return None
    ms = state.models.get(model)
    if version <= current(cfg, state, model) or (
        ms is not None and version in ms.bad and rollout.retry <= ms.retried.get(str(version), 0)
    ):
        return None
    if bundle.machine() not in info.get("platforms", [bundle.machine()]):
        return None
    minimum = version_tuple(str(info.get("min_appliance_version", "0")))
    if minimum > version_tuple(__version__):
        return None
    return model, version


def _info(target: TargetFile) -> dict[str, Any] | None:
    custom = target.custom if isinstance(target.custom, dict) else {}
    info = custom.get("appliance")
    return info if isinstance(info, dict) else None


def _size(info: dict[str, Any], key: str) -> int:
    value = info.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def offers(cfg: OtaConfig, state: AgentState, targets: Metadata[Targets]) -> dict[str, Offer]:
    """The newest applicable bundle of each model."""
    best: dict[str, Offer] = {}
    pinned = pins(cfg, targets)
    for target in targets.signed.targets.values():
        info = _info(target)
        if info is not None and info.get("kind") == "software":
            continue  # the appliance itself: ota.selfupdate
        chosen = applies(cfg, state, info, pinned) if info is not None else None
        if info is None or chosen is None:
            continue
        model, version = chosen
        if model in best and version <= best[model].version:
            continue
        best[model] = Offer(
            model, version, target, _size(info, "memory_bytes"), _size(info, "unpacked_bytes")
        )
    return best


def newest_offer(cfg: OtaConfig, state: AgentState, fresh: Fresh | None = None) -> Offer | None:
    """The newest applicable bundle of the first model (by name) that has one."""
    best = offers(cfg, state, (fresh or refresh(cfg)).targets)
    return best[min(best)] if best else None


def signed_backend(fresh: Fresh, path: str) -> str:
    """The backend the signed target at ``path`` claims ("" when it does not say)."""
    target = fresh.targets.signed.targets.get(path)
    info = _info(target) if target is not None else None
    backend = info.get("backend") if info is not None else None
    return backend if isinstance(backend, str) else ""


def delta_for(fresh: Fresh, offer: Offer, base: int) -> dict[str, Any]:
    """The signed delta from version ``base`` to the offered one, as the job keeps it
    ({}: none published, or its target or the content hashes are missing)."""
    info = _info(offer.target)
    row = delta.listed(info).get(base) if base else None
    content = info.get("content") if info is not None else None
    target = fresh.targets.signed.targets.get(row["path"]) if row is not None else None
    if target is None or not isinstance(content, dict):
        return {}
    hashes = {k: content.get(k) for k in ("manifest_sha256", "config_sha256")}
    if not all(isinstance(h, str) for h in hashes.values()):
        return {}
    sha256 = target.hashes.get("sha256", "")
    return {"target": target.path, "length": target.length, "sha256": sha256, "base": base,
            **hashes}  # fmt: skip


def still_wanted(cfg: OtaConfig, state: AgentState, job: Job, fresh: Fresh) -> str:
    """Why the fleet no longer wants ``job`` ("" while it does): removed from the
    signed targets, its bytes changed, its rollout halted or narrowed past this
    device, or a newer version offered instead."""
    target = fresh.targets.signed.targets.get(job.target)
    if target is None:
        return f"{job.model} version {job.version} was removed from the signed targets"
    if target.length != job.length or target.hashes.get("sha256") != job.sha256:
        return f"the signed target of {job.model} version {job.version} changed"
    info = _info(target)
    pinned = pins(cfg, fresh.targets)
    if info is None or applies(cfg, state, info, pinned) != (job.model, job.version):
        return (
            f"the fleet no longer offers {job.model} version {job.version} to this "
            "device (rollout halted or narrowed)"
        )
    newer = offers(cfg, state, fresh.targets).get(job.model)
    if newer is not None and newer.version > job.version:
        return f"{job.model} version {newer.version} supersedes version {job.version}"
    return ""


def fits_budget(cfg: OtaConfig, api: ServerApi, offer: Offer) -> None:
    """Refuse before anything changes when the budget cannot hold the new copy next
    to everything loaded now (the old copy serves during the swap)."""
    limit, needed = cfg.memory_limit, offer.memory_bytes
    if limit is None or not needed:
        return
    used = api.memory_in_use()
    if needed > limit - used:
        raise OtaError(
            f"{offer.model} version {offer.version}: the bundle needs about {needed} bytes, "
            f"but the memory budget is {limit} bytes with {used} in use; not installing it"
        )
