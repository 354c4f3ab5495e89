"""The device telemetry's metric families: one table of names, kinds, units and labels.

Units are in the names (``_celsius``, ``_hertz``, ``_watts``, ``_joules``, ``_ratio``).
A *counter* is exposed with ``_total`` appended (``appliance_energy_joules_total``);
:func:`exposed` gives the name a scraper sees. Nothing here reads a file: the
readers (``thermal``, ``cpufreq``, ``power``, ``jetson``, ``nvml``, ``jtop``) produce
:class:`Sample` rows of these families, and the Prometheus adapter turns them into
metric families.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol


@dataclass(frozen=True)
class Family:
    name: str
    kind: Literal["gauge", "counter"]
    help: str
    labels: tuple[str, ...]


class Sample(NamedTuple):
    """One value of a family; ``labels`` are the values in ``family.labels``' order."""

    family: Family
    labels: tuple[str, ...]
    value: float


class Source(Protocol):
    """One kind of telemetry found at discovery; ``read`` appends this scrape's samples
    (a value that cannot be read now is left out) and never raises for a missing file."""

    name: str

    def read(self, out: list[Sample]) -> None: ...

    def describe(self) -> str:
        """What was found, for ``appliance doctor`` (one short phrase)."""
        ...


def exposed(family: Family) -> str:
    """The sample name a scraper sees (counters get ``_total``)."""
    return family.name + "_total" if family.kind == "counter" else family.name


TEMPERATURE = Family(
    "appliance_temperature_celsius",
    "gauge",
    "Temperature of a sensor (thermal zone, CPU hwmon chip or GPU)",
    ("sensor", "kind", "source"),
)
TEMPERATURE_THROTTLE = Family(
    "appliance_temperature_throttle_celsius",
    "gauge",
    "The lowest passive trip point of a thermal zone: where the kernel starts throttling",
    ("sensor", "kind", "source"),
)
THROTTLE_EVENTS = Family(
    "appliance_throttle_events",
    "counter",
    "Throttling events the hardware counted since boot (CPU thermal throttling, "
    "Jetson over-current and under-voltage)",
    ("source",),
)
CPU_FREQUENCY = Family(
    "appliance_cpu_frequency_hertz",
    "gauge",
    "Current frequency of a cpufreq policy (a group of CPUs)",
    ("policy", "cpus"),
)
CPU_FREQUENCY_LIMIT = Family(
    "appliance_cpu_frequency_limit_hertz",
    "gauge",
    "The frequency a cpufreq policy may reach now (scaling_max_freq: lowered by power "
    "modes and thermal capping)",
    ("policy", "cpus"),
)
CPU_FREQUENCY_MAX = Family(
    "appliance_cpu_frequency_max_hertz",
    "gauge",
    "The hardware's highest frequency for a cpufreq policy (cpuinfo_max_freq)",
    ("policy", "cpus"),
)
POWER = Family(
    "appliance_power_watts",
    "gauge",
    "Power drawn on a rail (Jetson INA3221 monitors, NVML board power)",
    ("rail", "sensor"),
)
ENERGY = Family(
    "appliance_energy_joules",
    "counter",
    "Energy consumed by a domain (x86 RAPL through powercap, NVML)",
    ("domain", "sensor"),
)
GPU_UTILIZATION = Family(
    "appliance_gpu_utilization_ratio",
    "gauge",
    "GPU busy fraction, 0 to 1 (Jetson devfreq load, NVML utilization)",
    ("gpu",),
)
GPU_FREQUENCY = Family("appliance_gpu_frequency_hertz", "gauge", "Current GPU clock", ("gpu",))
GPU_FREQUENCY_LIMIT = Family(
    "appliance_gpu_frequency_limit_hertz",
    "gauge",
    "The GPU clock allowed now (devfreq max_freq; NVML's maximum SM clock)",
    ("gpu",),
)
GPU_THROTTLE = Family(
    "appliance_gpu_throttle_active",
    "gauge",
    "1 while NVML reports the GPU's clocks held down for this reason",
    ("gpu", "reason"),
)
EMC_FREQUENCY = Family(
    "appliance_emc_frequency_hertz",
    "gauge",
    "External memory controller (EMC) clock, where exposed",
    ("source",),
)
EMC_FREQUENCY_LIMIT = Family(
    "appliance_emc_frequency_limit_hertz",
    "gauge",
    "The EMC clock cap the Jetson power mode sets",
    ("source",),
)
EMC_UTILIZATION = Family(
    "appliance_emc_utilization_ratio",
    "gauge",
    "Memory bandwidth used, 0 to 1 of what the EMC clock allows (from jetson-stats)",
    ("source",),
)
POWER_MODE = Family(
    "appliance_power_mode_info",
    "gauge",
    "The Jetson power mode (nvpmodel) in force: always 1, the mode in the labels",
    ("id", "mode"),
)

ALL = (
    TEMPERATURE,
    TEMPERATURE_THROTTLE,
    THROTTLE_EVENTS,
    CPU_FREQUENCY,
    CPU_FREQUENCY_LIMIT,
    CPU_FREQUENCY_MAX,
    POWER,
    ENERGY,
    GPU_UTILIZATION,
    GPU_FREQUENCY,
    GPU_FREQUENCY_LIMIT,
    GPU_THROTTLE,
    EMC_FREQUENCY,
    EMC_FREQUENCY_LIMIT,
    EMC_UTILIZATION,
    POWER_MODE,
)
