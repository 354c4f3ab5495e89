"""Fleet controls on a published version's rollout: widen, narrow, halt or resume
it, retry the devices that failed, widen through approved phases, pin devices to it.

Each change re-signs the targets (and a new snapshot and timestamp) through
:mod:`.repo`; the settings themselves are :class:`.rollout.Rollout`, signed in
the target's ``custom`` field, so a device reads them only from verified metadata.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tuf.api.metadata import Metadata, TargetFile, Targets

from appliance.ota import OtaError, software
from appliance.ota.repo import Expiry, _load, _sign_chain
from appliance.ota.rollout import Rollout, check_name


def set_rollout(
    repo: Path,
    keys_dir: Path,
    model: str,
    version: int | str = 0,
    percent: float | None = None,
    halted: bool | None = None,
    expiry: Expiry | None = None,
    *,
    retry_failed: bool = False,
    approve: str = "",
    pin: tuple[str, ...] = (),
    unpin: tuple[str, ...] = (),
) -> Rollout:
    """Change the rollout of ``model`` (its newest published version unless
    ``version``; ``appliance`` names the software) and re-sign; returns the new
    settings. ``retry_failed``: the devices that marked the version bad take it
    again; ``approve``: widen to the next phase, recording who approved; a rollout
    published with phases widens no other way. ``pin``/``unpin``: devices that take
    this version and no other of the model."""
    targets: Metadata[Targets] = _load(repo / "metadata", "targets")
    candidates = {
        str(t.custom["appliance"].get("version")): t
        for t in targets.signed.targets.values()
        if isinstance(t.custom, dict) and t.custom.get("appliance", {}).get("name") == model
    }
    if not candidates:
        raise OtaError(f"no bundle of model '{model}' is published in {repo}")
    chosen = str(version) if version else max(candidates, key=software.version_key)
    if chosen not in candidates:
        raise OtaError(f"model '{model}' version {chosen} is not published in {repo}")
    target = candidates[chosen]
    info = dict(target.custom["appliance"])
    current = Rollout.from_json(info.get("rollout", {}))
    new = current.changed(percent=percent, halted=halted)
    if current.phases and percent is not None and percent > current.percent:
        raise OtaError(
            f"{model} {chosen} widens by approval only (phases {list(current.phases)}): "
            "fleet rollout --approve"
        )
    if approve:
        check_name(approve, "approver")
        step = current.next_phase()
        if step is None:
            raise OtaError(f"{model} {chosen}: no phase left to approve ({current.percent:g}%)")
        new = replace(new, percent=step, approvals=(*new.approvals, f"{approve}:{step:g}%"))
    if retry_failed:
        new = replace(new, retry=new.retry + 1)
    for device in pin:
        check_name(device, "device_id")
        for other in candidates.values():  # one pinned version per device and model
            _unpin(other, device)
    info = dict(target.custom["appliance"])  # (after _unpin: it may be this target)
    kept = tuple(d for d in Rollout.from_json(info.get("rollout", {})).pinned if d not in unpin)
    new = replace(new, pinned=tuple(sorted({*kept, *pin})))
    info["rollout"] = new.to_json()
    target.unrecognized_fields["custom"] = {"appliance": info}
    _sign_chain(repo, keys_dir, targets, expiry or Expiry(), bump=True)
    return new


def _unpin(target: TargetFile, device: str) -> None:
    info = dict(target.custom["appliance"])
    rollout = Rollout.from_json(info.get("rollout", {}))
    if device in rollout.pinned:
        info["rollout"] = replace(
            rollout, pinned=tuple(d for d in rollout.pinned if d != device)
        ).to_json()
        target.unrecognized_fields["custom"] = {"appliance": info}
