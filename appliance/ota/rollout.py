"""Which devices a rollout includes: channel, groups, percentage, halted.

Membership is decided on the device from its own id, with no coordination: the
device's bucket is the first 32 bits of sha256("<model>/<device_id>") scaled to
[0, 100), and it is in a rollout of P percent when its bucket is below P. The
bucket depends on the model, not the version, so raising P only adds devices
(those already in stay in), and the same early devices lead every release of a
model, as canary fleets do.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from typing import Any

from appliance.ota import OtaError

CHANNELS = ("stable", "beta")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_name(value: str, what: str) -> str:
    """A device id, group or model name: it ends up in MQTT topics and file names."""
    if not _NAME.fullmatch(value):
        raise OtaError(
            f"{what} {value!r}: expected 1-64 characters of letters, digits, '.', '_' "
            f"or '-', starting with a letter or digit"
        )
    return value


def bucket(model: str, device_id: str) -> float:
    """The device's place in [0, 100) for this model's rollouts."""
    digest = hashlib.sha256(f"{model}/{device_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 * 100


@dataclass(frozen=True, slots=True)
class Rollout:
    """A published bundle's rollout settings (signed in the targets metadata)."""

    channel: str = "stable"
    percent: float = 100.0
    groups: tuple[str, ...] = ()  # (): every group
    halted: bool = False
    # fleet controls: ``retry`` is raised by ``fleet rollout --retry-failed`` (a device
    # that marked this version bad at a lower retry takes it again); ``pinned`` devices
    # take this version whatever the percentage and no other version of the model;
    # ``phases`` (percents) widen only by ``fleet rollout --approve``, each approval
    # kept in ``approvals`` (who, to what percent)
    retry: int = 0
    pinned: tuple[str, ...] = ()
    phases: tuple[float, ...] = ()
    approvals: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.channel not in CHANNELS:
            raise OtaError(f"channel {self.channel!r}: expected one of {', '.join(CHANNELS)}")
        if not 0 <= self.percent <= 100:
            raise OtaError(f"percent {self.percent!r}: expected 0..100")
        for g in self.groups:
            check_name(g, "group")
        for d in self.pinned:
            check_name(d, "device_id")
        if list(self.phases) != sorted(set(self.phases)) or not all(
            0 <= p <= 100 for p in self.phases
        ):
            raise OtaError(f"phases {list(self.phases)}: expected increasing percents")
        if self.retry < 0:
            raise OtaError("retry: expected a count")

    def next_phase(self) -> float | None:
        """The percent the next approval widens to (None: no phase left)."""
        return next((p for p in self.phases if p > self.percent), None)

    def includes(self, model: str, device_id: str, channel: str, groups: tuple[str, ...]) -> bool:
        """Whether this rollout offers the bundle to that device. A device on the beta
        channel also takes stable releases; a stable device never takes beta ones."""
        if self.halted:
            return False
        if device_id in self.pinned:
            return True
        if self.channel == "beta" and channel != "beta":
            return False
        if self.groups and not set(self.groups) & set(groups):
            return False
        return bucket(model, device_id) < self.percent

    def changed(self, percent: float | None = None, halted: bool | None = None) -> Rollout:
        return replace(
            self,
            percent=self.percent if percent is None else float(percent),
            halted=self.halted if halted is None else halted,
        )

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "channel": self.channel,
            # TUF's canonical JSON has no floats: hundredths of a percent, as an integer
            "basis_points": round(self.percent * 100),
            "groups": list(self.groups),
            "halted": self.halted,
        }
        extra = {"retry": self.retry, "pinned": list(self.pinned),
                 "phases": [round(p * 100) for p in self.phases],
                 "approvals": list(self.approvals)}  # fmt: skip
        return {**doc, **{k: v for k, v in extra.items() if v}}

    @classmethod
    def from_json(cls, data: Any) -> Rollout:
        """From signed metadata; anything malformed is an OtaError (the target is skipped)."""
        if not isinstance(data, dict):
            raise OtaError("rollout settings: expected an object")
        channel, points = data.get("channel", "stable"), data.get("basis_points", 10000)
        groups, halted = data.get("groups", []), data.get("halted", False)
        if not isinstance(channel, str) or not isinstance(halted, bool):
            raise OtaError("rollout settings: channel must be a string, halted a boolean")
        if not isinstance(points, int) or isinstance(points, bool):
            raise OtaError("rollout settings: basis_points must be an integer")
        if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
            raise OtaError("rollout settings: groups must be a list of names")
        retry, pinned = data.get("retry", 0), data.get("pinned", [])
        phases, approvals = data.get("phases", []), data.get("approvals", [])
        if not isinstance(retry, int) or isinstance(retry, bool):
            raise OtaError("rollout settings: retry must be an integer")
        for name, items, kind in (("pinned", pinned, str), ("phases", phases, int),
                                  ("approvals", approvals, str)):  # fmt: skip
            if not isinstance(items, list) or not all(
                isinstance(x, kind) and not isinstance(x, bool) for x in items
            ):
                raise OtaError(f"rollout settings: {name} must be a list")
        return cls(channel, points / 100, tuple(groups), halted, retry, tuple(pinned),
                   tuple(p / 100 for p in phases), tuple(approvals))  # fmt: skip
