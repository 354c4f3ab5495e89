"""Temperatures and throttling: thermal zones, CPU/GPU hwmon chips, throttle counters.

- Thermal zones (``/sys/class/thermal/thermal_zone*``): ``type`` names the sensor
  (``cpu-thermal``, ``gpu-thermal``, ``tj-thermal`` on a Jetson Orin; ``x86_pkg_temp``,
  ``acpitz`` on a PC), ``temp`` is in millidegrees. The lowest ``passive`` trip point,
  read once at discovery, is where the kernel starts throttling.
- hwmon chips that measure the CPU or GPU (``coretemp``, ``k10temp``, ``amdgpu``):
  ``temp*_input`` with ``temp*_label``.
- Throttle counters: Intel's per-CPU ``thermal_throttle/{core,package}_throttle_count``
  (one counter per core and per package, de-duplicated through ``topology``), and the
  Jetson Orin ``soctherm_oc`` hwmon's ``oc*_event_cnt`` (under-voltage and over-current
  events, each of which throttles the CPU and GPU).
"""

from __future__ import annotations

import os

from appliance.telemetry import families as f
from appliance.telemetry.files import listdir, read_int, read_text

# thermal zone type (lowercase) -> kind, by prefix; the first that matches
_KINDS = (
    ("cpu", "cpu"),
    ("x86_pkg_temp", "cpu"),
    ("tcpu", "cpu"),
    ("gpu", "gpu"),
    ("soc", "soc"),
    ("tj", "junction"),
    ("cv", "cv"),
    ("acpitz", "board"),
    ("tboard", "board"),
    ("pch", "chipset"),
)
HWMON_CHIPS = {"coretemp": "cpu", "k10temp": "cpu", "zenpower": "cpu", "amdgpu": "gpu"}
OC_HWMON = "soctherm_oc"


def kind_of(zone_type: str) -> str:
    lowered = zone_type.lower()
    for prefix, kind in _KINDS:
        if lowered.startswith(prefix):
            return kind
    return "other"


def _passive_trip(zone: str) -> float | None:
    """The lowest passive trip point in degrees (None when the zone has none)."""
    lowest = None
    for name in listdir(zone):
        if not (name.startswith("trip_point_") and name.endswith("_type")):
            continue
        if read_text(os.path.join(zone, name)) != "passive":
            continue
        temp = read_int(os.path.join(zone, name[: -len("type")] + "temp"))
        if temp is not None and temp > 0 and (lowest is None or temp < lowest):
            lowest = temp
    return None if lowest is None else lowest / 1000


class Temperatures:
    """Thermal zones and CPU/GPU hwmon temperatures."""

    name = "temperatures"

    def __init__(self, sensors: list[tuple[str, tuple[str, str, str], float | None]]) -> None:
        # (temp file, (sensor, kind, source) labels, passive trip in degrees)
        self.sensors = sensors

    @classmethod
    def discover(cls, root: str) -> Temperatures | None:
        sensors: list[tuple[str, tuple[str, str, str], float | None]] = []
        seen: set[str] = set()
        base = os.path.join(root, "sys/class/thermal")
        for entry in listdir(base):
            zone = os.path.join(base, entry)
            zone_type = read_text(os.path.join(zone, "type"))
            temp = os.path.join(zone, "temp")
            if not entry.startswith("thermal_zone") or not zone_type or not os.path.exists(temp):
                continue
            sensor = zone_type if zone_type not in seen else f"{zone_type} ({entry})"
            seen.add(zone_type)
            labels = (sensor, kind_of(zone_type), "thermal_zone")
            sensors.append((temp, labels, _passive_trip(zone)))
        base = os.path.join(root, "sys/class/hwmon")
        for entry in listdir(base):
            chip = os.path.join(base, entry)
            chip_name = read_text(os.path.join(chip, "name")) or ""
            kind = HWMON_CHIPS.get(chip_name)
            if kind is None:
                continue
            for name in listdir(chip):
                if not (name.startswith("temp") and name.endswith("_input")):
                    continue
                label = read_text(os.path.join(chip, name[: -len("input")] + "label"))
                sensor = f"{chip_name} {label or name[: -len('_input')]}"
                sensors.append((os.path.join(chip, name), (sensor, kind, "hwmon"), None))
        return cls(sensors) if sensors else None

    def read(self, out: list[f.Sample]) -> None:
        for path, labels, trip in self.sensors:
            value = read_int(path)
            if value is None:  # a power-gated zone (Orin's cv*) answers EAGAIN
                continue
            out.append(f.Sample(f.TEMPERATURE, labels, value / 1000))
            if trip is not None:
                out.append(f.Sample(f.TEMPERATURE_THROTTLE, labels, trip))

    def describe(self) -> str:
        names = [labels[0] for _, labels, _ in self.sensors]
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        return f"{len(names)} temperature sensors ({shown})"


class ThrottleCounters:
    """Hardware throttle event counters (cumulative since boot)."""

    name = "throttle counters"

    def __init__(self, counters: list[tuple[str, list[str]]]) -> None:
        # (source label, files whose values add up to it)
        self.counters = counters

    @classmethod
    def discover(cls, root: str) -> ThrottleCounters | None:
        counters: list[tuple[str, list[str]]] = []
        cpu_base = os.path.join(root, "sys/devices/system/cpu")
        cores: dict[tuple[str, str], str] = {}
        packages: dict[str, str] = {}
        for entry in listdir(cpu_base):
            if not (entry.startswith("cpu") and entry[3:].isdigit()):
                continue
            throttle = os.path.join(cpu_base, entry, "thermal_throttle")
            if not os.path.isdir(throttle):
                continue
            package = read_text(os.path.join(cpu_base, entry, "topology/physical_package_id"))
            core = read_text(os.path.join(cpu_base, entry, "topology/core_id"))
            package = package or "0"
            core_file = os.path.join(throttle, "core_throttle_count")
            package_file = os.path.join(throttle, "package_throttle_count")
            if os.path.exists(core_file):
                cores.setdefault((package, core or entry), core_file)
            if os.path.exists(package_file):
                packages.setdefault(package, package_file)
        if cores:
            counters.append(("cpu_core_thermal", list(cores.values())))
        if packages:
            counters.append(("cpu_package_thermal", list(packages.values())))
        hwmon = os.path.join(root, "sys/class/hwmon")
        for entry in listdir(hwmon):
            chip = os.path.join(hwmon, entry)
            if read_text(os.path.join(chip, "name")) != OC_HWMON:
                continue
            for name in listdir(chip):
                if name.startswith("oc") and name.endswith("_event_cnt"):
                    counters.append((name[: -len("_event_cnt")], [os.path.join(chip, name)]))
        return cls(counters) if counters else None

    def read(self, out: list[f.Sample]) -> None:
        for source, paths in self.counters:
            values = [read_int(p) for p in paths]
            known = [v for v in values if v is not None]
            if known:
                out.append(f.Sample(f.THROTTLE_EVENTS, (source,), float(sum(known))))

    def describe(self) -> str:
        return "throttle counters (" + ", ".join(s for s, _ in self.counters) + ")"
