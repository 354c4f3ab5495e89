"""The device's telemetry: what exists is found once, then read cheaply at each scrape.

:meth:`Telemetry.discover` looks under a root (``/`` on a device; a recorded tree in
the tests) for every kind of source and keeps those that exist: thermal zones and
CPU/GPU temperature chips, throttle counters, cpufreq, INA3221 rails, RAPL energy,
the Jetson GPU's devfreq node, the EMC clock, the nvpmodel power mode, NVML on a
discrete GPU, jetson-stats. :meth:`Telemetry.read` then reads only the files found
(a few dozen small sysfs reads). A source that is missing is absent; one that fails
at a scrape (a file gone, a driver answering EAGAIN) gives fewer samples, never an
exception.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from appliance.telemetry import families as f
from appliance.telemetry.cpufreq import CpuFrequency
from appliance.telemetry.jetson import DevfreqGpu, Emc, PowerMode
from appliance.telemetry.jetson_stats import Jtop
from appliance.telemetry.nvml import Nvml
from appliance.telemetry.power import Ina3221, Rapl
from appliance.telemetry.thermal import Temperatures, ThrottleCounters

log = logging.getLogger(__name__)

SYSFS: tuple[Callable[[str], f.Source | None], ...] = (
    Temperatures.discover,
    ThrottleCounters.discover,
    CpuFrequency.discover,
    Ina3221.discover,
    Rapl.discover,
    DevfreqGpu.discover,
    Emc.discover,
    PowerMode.discover,
)
# libraries with their own connection: only on the real root, imported lazily
LIBRARIES: tuple[Callable[[str], f.Source | None], ...] = (Nvml.discover, Jtop.discover)


class Telemetry:
    """The sources found on this device; ``read()`` gives this scrape's samples."""

    def __init__(self, sources: Iterable[f.Source]) -> None:
        self.sources = list(sources)
        self._failed: set[str] = set()

    @classmethod
    def discover(cls, root: str = "/", libraries: bool = True) -> Telemetry:
        found = []
        for discover in SYSFS + (LIBRARIES if libraries else ()):
            try:
                source = discover(root)
            except Exception as exc:  # an unexpected layout: that source is absent
                log.warning("device telemetry: %s: %s", discover.__qualname__, exc)
                continue
            if source is not None:
                found.append(source)
        return cls(found)

    def read(self) -> list[f.Sample]:
        out: list[f.Sample] = []
        for source in self.sources:
            try:
                source.read(out)
            except Exception as exc:  # a kernel that answers oddly must not fail the scrape
                if source.name not in self._failed:
                    self._failed.add(source.name)
                    log.warning("device telemetry: reading %s failed: %s", source.name, exc)
        return out

    def describe(self) -> list[str]:
        return [source.describe() for source in self.sources]

    def close(self) -> None:
        for source in self.sources:
            close = getattr(source, "close", None)
            if close is not None:
                close()
