"""What a set of samples says about the device: hottest sensors, throttling, power.

Shared by ``appliance doctor`` (one line about the device now) and ``appliance perf``
(did the device throttle during a run: a throttle counter went up, a sensor reached
its throttle trip point, or NVML held a GPU's clocks down). Samples may come from this
process's own reading or back from a scrape of another server (:func:`from_exposed`).
"""

from __future__ import annotations

from collections.abc import Iterable

from appliance.telemetry import families as f

_BY_EXPOSED = {f.exposed(fam): fam for fam in f.ALL}


def from_exposed(name: str, labels: dict[str, str], value: float) -> f.Sample | None:
    """A scraped sample back as a :class:`Sample` (None when not a telemetry family)."""
    family = _BY_EXPOSED.get(name)
    if family is None:
        return None
    return f.Sample(family, tuple(labels.get(label, "") for label in family.labels), value)


def _of(samples: Iterable[f.Sample], family: f.Family) -> list[f.Sample]:
    return [s for s in samples if s.family is family or s.family.name == family.name]


def throttle_counts(samples: Iterable[f.Sample]) -> dict[str, float]:
    return {s.labels[0]: s.value for s in _of(samples, f.THROTTLE_EVENTS)}


def at_throttle_trip(samples: list[f.Sample]) -> list[str]:
    """Sensors whose temperature has reached their passive trip point."""
    trips = {s.labels: s.value for s in _of(samples, f.TEMPERATURE_THROTTLE)}
    return [
        s.labels[0]
        for s in _of(samples, f.TEMPERATURE)
        if s.labels in trips and s.value >= trips[s.labels]
    ]


def gpu_throttling(samples: Iterable[f.Sample]) -> list[str]:
    return [f"gpu{s.labels[0]} {s.labels[1]}" for s in _of(samples, f.GPU_THROTTLE) if s.value]


def hottest(samples: Iterable[f.Sample]) -> float | None:
    temps = [s.value for s in _of(samples, f.TEMPERATURE)]
    return max(temps) if temps else None


def throttled(before: list[f.Sample], after: list[f.Sample]) -> tuple[int, list[str]]:
    """(throttle events counted between the two readings, why it throttled: [] if not)."""
    old, new = throttle_counts(before), throttle_counts(after)
    events = {k: int(v - old[k]) for k, v in new.items() if k in old and v > old[k]}
    why = [f"{n} {k} events" for k, n in events.items()]
    why += [f"{s} at its throttle temperature" for s in at_throttle_trip(after)]
    why += [f"{g} throttling" for g in sorted(set(gpu_throttling(before) + gpu_throttling(after)))]
    return sum(events.values()), why


def _by_kind(samples: list[f.Sample]) -> str:
    hottest_by_kind: dict[str, float] = {}
    for s in _of(samples, f.TEMPERATURE):
        kind = s.labels[1]
        hottest_by_kind[kind] = max(hottest_by_kind.get(kind, s.value), s.value)
    order = ("cpu", "gpu", "soc", "junction")
    kinds = sorted(hottest_by_kind, key=lambda k: (order.index(k) if k in order else 9, k))
    return ", ".join(f"{k} {hottest_by_kind[k]:.1f} C" for k in kinds[:4])


def summary(samples: list[f.Sample], found: list[str]) -> tuple[str, str]:
    """('ok' or 'warn', one line) for ``appliance doctor``."""
    if not found:
        return "ok", "no device telemetry here (no thermal zones, cpufreq, power monitors)"
    parts = [p for p in [_by_kind(samples)] if p]
    rails = _of(samples, f.POWER)
    if rails:
        total = next((s for s in rails if s.labels[0] == "VDD_IN"), None)
        shown = [total] if total else rails[:2]
        parts.append(", ".join(f"{s.labels[0]} {s.value:.2f} W" for s in shown))
    for s in _of(samples, f.POWER_MODE):
        parts.append(f"power mode {s.labels[1] or '?'} (id {s.labels[0]})")
    for s in _of(samples, f.GPU_UTILIZATION):
        parts.append(f"gpu {s.labels[0]} {s.value * 100:.0f}% busy")
    hot = at_throttle_trip(samples)
    counts = {k: v for k, v in throttle_counts(samples).items() if v > 0}
    gpus = gpu_throttling(samples)
    warnings = [f"{s} at its throttle temperature" for s in hot]
    warnings += [f"{int(v)} {k} throttle events since boot" for k, v in counts.items()]
    warnings += [f"{g} throttling now" for g in gpus]
    line = "; ".join(parts) or "; ".join(found)
    if warnings:
        return "warn", f"{line}; " + "; ".join(warnings)
    return "ok", line + ("; no throttling" if throttle_counts(samples) else "")
