"""Scheduling fields of a model config: dynamic batching's queue policies and an
instance group's rate-limiter needs (Triton's ``ModelQueuePolicy`` and
``ModelRateLimiter``), and the server's rate-limit setting (Triton's ``--rate-limit``
and ``--rate-limit-resource``).

What they mean at run time is :mod:`appliance.core.batch_queue` (queue policies) and
:mod:`appliance.core.rate_limiter` (resources and priorities).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from appliance.config.fields import ConfigError, Fields

TIMEOUT_ACTIONS = ("REJECT", "DELAY")
# a resource name: what the command line's NAME:COUNT[:DEVICE] can spell
_RESOURCE_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_UINT32_MAX = 2**32 - 1  # Triton's counts and priorities are uint32


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """One priority level's queue rules (Triton's ``ModelQueuePolicy``)."""

    max_queue_size: int = 0  # 0: the server's default_max_queue_size
    default_timeout_us: int = 0  # 0: no queue timeout
    # a request's own ``timeout`` may shorten the default (the appliance's default is
    # true, Triton's false: see docs/triton-compatibility.md)
    allow_timeout_override: bool = True
    timeout_action: str = "REJECT"  # REJECT: answered UNAVAILABLE; DELAY: served last

    def json(self) -> dict[str, Any]:
        return {
            "timeout_action": self.timeout_action,
            "default_timeout_microseconds": self.default_timeout_us,
            "allow_timeout_override": self.allow_timeout_override,
            "max_queue_size": self.max_queue_size,
        }


def parse_queue_policy(f: Fields) -> QueuePolicy:
    f.check_keys(
        {
            "max_queue_size",
            "default_timeout_microseconds",
            "allow_timeout_override",
            "timeout_action",
        }
    )
    action = f.text("timeout_action", "REJECT")
    if action not in TIMEOUT_ACTIONS:
        raise f.fail("timeout_action", f"expected REJECT or DELAY, got {action!r}")
    return QueuePolicy(
        max_queue_size=f.integer("max_queue_size", 0),
        default_timeout_us=f.integer("default_timeout_microseconds", 0),
        allow_timeout_override=f.flag("allow_timeout_override", True),
        timeout_action=action,
    )


def parse_priority_queue_policy(f: Fields, levels: int) -> tuple[tuple[int, QueuePolicy], ...]:
    """``priority_queue_policy``: a map from level (1..levels) to a policy. Protobuf's
    text and JSON forms give the keys as strings; YAML may give integers."""
    out: dict[int, QueuePolicy] = {}
    for key, value in f.data.items():
        text = str(key)
        if isinstance(key, bool) or not text.isdigit():
            raise f.fail(text, f"expected a priority level (an integer), got {key!r}")
        level = int(text)
        if not levels or not 1 <= level <= levels:
            raise f.fail(
                text,
                f"expected a priority level in 1..{levels} (priority_levels), got {level}"
                if levels
                else "priority_queue_policy needs priority_levels",
            )
        if level in out:
            raise f.fail(text, f"level {level} is given twice")
        out[level] = (
            QueuePolicy()
            if value is None
            else parse_queue_policy(Fields(f.source, value, f.at(text)))
        )
    return tuple(sorted(out.items()))


# ---- the rate limiter ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Resource:
    """What one instance of a group holds while it runs a batch."""

    name: str
    count: int
    is_global: bool = False  # shared by every device (one NPU, a DSP) rather than per device


@dataclass(frozen=True, slots=True)
class RateLimiterConfig:
    """An instance group's ``rate_limiter`` (Triton's ``ModelRateLimiter``)."""

    resources: tuple[Resource, ...] = ()
    priority: int = 1  # a weight: 2 gets half the turns of 1 (0 counts as 1, as Triton)


def resource_name_problem(name: object) -> str:
    if not isinstance(name, str) or not name:
        return f"expected a non-empty name, got {name!r}"
    if not _RESOURCE_NAME.fullmatch(name):
        return f"expected letters, digits, '_', '.' or '-', got {name!r}"
    return ""


def parse_rate_limiter(f: Fields) -> RateLimiterConfig:
    f.check_keys({"resources", "priority"})
    resources: list[Resource] = []
    for r in f.entries("resources"):
        r.check_keys({"name", "count", "global"})
        name = r.data.get("name")
        problem = resource_name_problem(name)
        if problem:
            raise r.fail("name", problem)
        assert isinstance(name, str)
        count = r.integer("count", 0)
        if count > _UINT32_MAX:
            raise r.fail("count", f"expected an integer of at most {_UINT32_MAX}, got {count}")
        if any(x.name == name for x in resources):
            raise r.fail("name", f"resource {name!r} is named twice in this group")
        resources.append(Resource(name, count, r.flag("global", False)))
    priority = f.integer("priority", 0)
    if priority > _UINT32_MAX:
        raise f.fail("priority", f"expected an integer of at most {_UINT32_MAX}, got {priority}")
    return RateLimiterConfig(tuple(resources), max(priority, 1))


# ---- the server's setting ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResourceTotal:
    """A ``rate_limit_resources`` entry: how many of ``name`` exist on ``device``
    (None: on each device; a global resource's total ignores the device)."""

    name: str
    count: int
    device: int | None = None

    def text(self) -> str:
        return f"{self.name}:{self.count}" + ("" if self.device is None else f":{self.device}")


def parse_resource_total(value: Any, source: str, key: str) -> ResourceTotal:
    """``NAME:COUNT[:DEVICE]`` (Triton's ``--rate-limit-resource``), or a mapping with
    ``name``, ``count`` and optionally ``device``."""
    if isinstance(value, dict):
        f = Fields(source, value, key)
        f.check_keys({"name", "count", "device"})
        if "count" not in value:
            raise f.fail("count", "expected the resource's count")
        name, count = value.get("name"), f.integer("count", 0)
        device = f.integer("device", 0) if "device" in value else None
    elif isinstance(value, str):
        parts = value.split(":")
        if len(parts) not in (2, 3) or not all(p.strip().isdigit() for p in parts[1:]):
            raise ConfigError(
                source, key, f"expected NAME:COUNT or NAME:COUNT:DEVICE, got {value!r}"
            )
        name, count = parts[0], int(parts[1])
        device = int(parts[2]) if len(parts) == 3 else None
    else:
        raise ConfigError(source, key, f"expected NAME:COUNT[:DEVICE] or a mapping, got {value!r}")
    problem = resource_name_problem(name)
    if problem:
        raise ConfigError(source, f"{key}.name" if isinstance(value, dict) else key, problem)
    assert isinstance(name, str)
    if count > _UINT32_MAX:
        raise ConfigError(source, key, f"count {count} exceeds {_UINT32_MAX}")
    return ResourceTotal(name, count, device)


def parse_rate_limit(f: Fields) -> tuple[str, tuple[ResourceTotal, ...]]:
    """The server's ``rate_limit`` (off | execution_count) and ``rate_limit_resources``."""
    mode = f.data.get("rate_limit", "off")
    if mode is False:  # YAML 1.1 reads a bare `off` as false
        mode = "off"
    if mode not in ("off", "execution_count"):
        raise f.fail("rate_limit", f"expected off or execution_count, got {mode!r}")
    raw = f.data.get("rate_limit_resources", [])
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list):
        raise f.fail("rate_limit_resources", f"expected a list, got {type(raw).__name__}")
    totals = tuple(
        parse_resource_total(v, f.source, f"{f.at('rate_limit_resources')}[{i}]")
        for i, v in enumerate(raw)
    )
    seen: set[tuple[str, int | None]] = set()
    for i, t in enumerate(totals):
        if (t.name, t.device) in seen:
            raise ConfigError(
                f.source,
                f"{f.at('rate_limit_resources')}[{i}]",
                f"{t.name!r} is given twice for "
                + ("each device" if t.device is None else f"device {t.device}"),
            )
        seen.add((t.name, t.device))
    if totals and mode == "off":
        raise f.fail("rate_limit_resources", "given while rate_limit is off")
    return mode, totals
