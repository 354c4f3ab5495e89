"""The check step: refresh the TUF metadata and pick the update this device takes.

ngclient does the trust work (signatures and thresholds, version numbers never
going back, expiry, snapshot consistency, root rotation from the pinned root);
this module only reads the verified targets and applies the rollout rules, the
bad-version list and what this machine can run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tuf.api import exceptions as tuf_errors
from tuf.api.metadata import Metadata, TargetFile, Targets
from tuf.ngclient import Updater

from appliance.version import __version__
from ota import OtaError, bundle, install
from ota.config import OtaConfig
from ota.manifest import version_tuple
from ota.rollout import Rollout
from ota.server_api import ServerApi
from ota.state import AgentState


@dataclass(frozen=True, slots=True)
class Offer:
    model: str
    version: int
    target: TargetFile
    memory_bytes: int


def updater(cfg: OtaConfig) -> Updater:
    """An ngclient Updater over the agent's metadata folder, bootstrapped from the
    pinned root the first time (later runs start from the last verified root)."""
    meta_dir = cfg.state_dir / "metadata"
    meta_dir.mkdir(parents=True, exist_ok=True)
    bootstrap = None
    if not (meta_dir / "root.json").exists():
        bootstrap = cfg.trusted_root.read_bytes()
    return Updater(
        str(meta_dir),
        cfg.source + "metadata/",
        str(cfg.state_dir / "downloads"),
        cfg.source + "targets/",
        bootstrap=bootstrap,
    )


def refresh(cfg: OtaConfig) -> Metadata[Targets]:
    """Refresh through ngclient; the verified top-level targets. OtaError saying why
    TUF refused the repository, or why it could not be reached."""
    try:
        updater(cfg).refresh()
        # written by ngclient only after it verified the file
        return Metadata.from_file(str(cfg.state_dir / "metadata" / "targets.json"))
    except tuf_errors.RepositoryError as exc:
        raise OtaError(
            f"TUF refused the repository metadata ({type(exc).__name__}): {exc}"
        ) from None
    except tuf_errors.DownloadError as exc:
        raise OtaError(f"cannot reach the update repository: {exc}") from None
    except OSError as exc:
        raise OtaError(f"cannot read the pinned root or metadata: {exc}") from None


def current(cfg: OtaConfig, state: AgentState, model: str) -> int:
    """The committed version: the agent's record, else the newest folder on disk."""
    ms = state.models.get(model)
    if ms is not None and ms.current:
        return ms.current
    on_disk = install.disk_versions(cfg.model_repository, model)
    return max(on_disk) if on_disk else 0


def applies(cfg: OtaConfig, state: AgentState, info: dict[str, Any]) -> tuple[str, int] | None:
    """(model, version) when this device should install the bundle, else None."""
    try:
        model, version = str(info["name"]), int(info["version"])
        rollout = Rollout.from_json(info.get("rollout", {}))
    except (KeyError, TypeError, ValueError, OtaError):
        return None
    if not rollout.includes(model, cfg.device_id, cfg.channel, cfg.groups):
        return None
    ms = state.models.get(model)
    if version <= current(cfg, state, model) or (ms is not None and version in ms.bad):
        return None
    if bundle.machine() not in info.get("platforms", [bundle.machine()]):
        return None
    minimum = version_tuple(str(info.get("min_appliance_version", "0")))
    if minimum > version_tuple(__version__):
        return None
    return model, version


def newest_offer(cfg: OtaConfig, state: AgentState) -> Offer | None:
    """The newest applicable bundle of the first model (by name) that has one."""
    targets = refresh(cfg)
    best: dict[str, Offer] = {}
    for target in targets.signed.targets.values():
        custom = target.custom if isinstance(target.custom, dict) else {}
        info = custom.get("appliance")
        chosen = applies(cfg, state, info) if isinstance(info, dict) else None
        if chosen is None or chosen[1] <= (best[chosen[0]].version if chosen[0] in best else 0):
            continue
        memory = info.get("memory_bytes", 0) if isinstance(info, dict) else 0
        best[chosen[0]] = Offer(chosen[0], chosen[1], target, int(memory or 0))
    return best[min(best)] if best else None


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
