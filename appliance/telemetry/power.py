"""Power and energy: Jetson INA3221 rail monitors and x86 RAPL energy counters.

- INA3221 (``/sys/bus/i2c/drivers/ina3221/<bus>-<addr>/hwmon/hwmon*``): per channel
  ``in<N>_label`` names the rail (``VDD_IN``, ``VDD_CPU_GPU_CV``, ``VDD_SOC`` on an
  Orin Nano/NX), ``in<N>_input`` is the bus voltage in mV and ``curr<N>_input`` the
  current in mA; their product is the rail's power. Channels labelled ``NC`` (not
  connected) and the ``sum of shunt voltages`` channel are skipped.
- RAPL (``/sys/class/powercap/intel-rapl:*``): ``energy_uj`` counts microjoules per
  domain (``package-0``, ``core``, ``uncore``, ``dram``, ``psys``) and wraps at
  ``max_energy_range_uj``; the wrap is carried here so the exposed counter only goes
  up. Since Linux 5.10 ``energy_uj`` is readable by root only: for any other user the
  domain is absent.
"""

from __future__ import annotations

import os

from appliance.telemetry import families as f
from appliance.telemetry.files import listdir, read_int, read_text

INA3221_DRIVER = "sys/bus/i2c/drivers/ina3221"
_SKIP_LABELS = ("NC", "sum of shunt voltages")


class Ina3221:
    name = "ina3221"

    def __init__(self, rails: list[tuple[str, str, tuple[str, str]]]) -> None:
        # (voltage file, current file, (rail, sensor) labels)
        self.rails = rails

    @classmethod
    def discover(cls, root: str) -> Ina3221 | None:
        rails = []
        driver = os.path.join(root, INA3221_DRIVER)
        for device in listdir(driver):
            hwmon = os.path.join(driver, device, "hwmon")
            for chip in listdir(hwmon):
                folder = os.path.join(hwmon, chip)
                for name in listdir(folder):
                    if not (name.startswith("in") and name.endswith("_label")):
                        continue
                    channel = name[2 : -len("_label")]
                    label = read_text(os.path.join(folder, name))
                    volts = os.path.join(folder, f"in{channel}_input")
                    amps = os.path.join(folder, f"curr{channel}_input")
                    if not label or label in _SKIP_LABELS:
                        continue
                    if os.path.exists(volts) and os.path.exists(amps):
                        rails.append((volts, amps, (label, f"ina3221 {device}")))
        return cls(rails) if rails else None

    def read(self, out: list[f.Sample]) -> None:
        for volts, amps, labels in self.rails:
            mv, ma = read_int(volts), read_int(amps)
            if mv is not None and ma is not None:
                out.append(f.Sample(f.POWER, labels, mv * ma / 1e6))

    def describe(self) -> str:
        return "INA3221 rails (" + ", ".join(labels[0] for _, _, labels in self.rails) + ")"


class Rapl:
    name = "rapl"

    def __init__(self, domains: list[tuple[str, tuple[str, str], int]], unreadable: int) -> None:
        # (energy_uj file, (domain, sensor) labels, wrap range in uJ)
        self.domains = domains
        self.unreadable = unreadable
        self._last: dict[str, int] = {}
        self._carried: dict[str, int] = {}

    @classmethod
    def discover(cls, root: str) -> Rapl | None:
        base = os.path.join(root, "sys/class/powercap")
        domains, unreadable = [], 0
        for entry in listdir(base):
            zone = os.path.join(base, entry)
            energy = os.path.join(zone, "energy_uj")
            if not entry.startswith("intel-rapl") or ":" not in entry:
                continue
            if not os.path.exists(energy):
                continue
            if read_int(energy) is None:  # root only since Linux 5.10
                unreadable += 1
                continue
            name = read_text(os.path.join(zone, "name")) or entry
            wrap = read_int(os.path.join(zone, "max_energy_range_uj")) or 0
            domains.append((energy, (name, entry), wrap))
        return cls(domains, unreadable) if domains or unreadable else None

    def read(self, out: list[f.Sample]) -> None:
        for path, labels, wrap in self.domains:
            raw = read_int(path)
            if raw is None:
                continue
            last = self._last.get(path)
            if last is not None and raw < last and wrap > 0:
                self._carried[path] = self._carried.get(path, 0) + wrap
            self._last[path] = raw
            out.append(f.Sample(f.ENERGY, labels, (raw + self._carried.get(path, 0)) / 1e6))

    def describe(self) -> str:
        if not self.domains:
            return f"RAPL energy: {self.unreadable} domains readable by root only"
        return "RAPL energy (" + ", ".join(labels[0] for _, labels, _ in self.domains) + ")"
