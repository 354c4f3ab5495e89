"""Jetson's integrated GPU, memory clock and power mode.

- GPU (devfreq): ``/sys/class/devfreq/<addr>.<name>`` where the name is the GPU's
  (``17000000.gpu`` on JetPack 6, ``17000000.ga10b`` on JetPack 5 Orin); ``cur_freq``
  and ``max_freq`` are in Hz, ``device/load`` is the busy fraction in tenths of a
  percent (0-1000).
- EMC: ``/sys/kernel/debug/bpmp/debug/clk/emc/rate`` (Hz; debugfs, readable by root
  only) and the cap the power mode sets, ``/sys/kernel/nvpmodel_clk_cap/emc`` (Hz).
- Power mode: ``/var/lib/nvpmodel/status`` holds ``pmode:<id>`` (what ``nvpmodel``
  writes when a mode is set); the names come from ``/etc/nvpmodel.conf``'s
  ``< POWER_MODEL ID=<id> NAME=<name> >`` lines, read once.
"""

from __future__ import annotations

import os
import re

from appliance.telemetry import families as f
from appliance.telemetry.files import listdir, read_int, read_text

GPU_NAMES = ("gpu", "ga10b", "gv11b", "gp10b", "gb10b")
EMC_RATE = "sys/kernel/debug/bpmp/debug/clk/emc/rate"
EMC_CAP = "sys/kernel/nvpmodel_clk_cap/emc"
NVPMODEL_STATUS = "var/lib/nvpmodel/status"
NVPMODEL_CONF = "etc/nvpmodel.conf"
_PMODE = re.compile(r"pmode:(\d+)")
_MODEL = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=(\S+?)\s*>")


class DevfreqGpu:
    name = "devfreq gpu"

    def __init__(self, gpus: list[tuple[str, str]]) -> None:
        self.gpus = gpus  # (devfreq folder, gpu label)

    @classmethod
    def discover(cls, root: str) -> DevfreqGpu | None:
        base = os.path.join(root, "sys/class/devfreq")
        gpus = []
        for entry in listdir(base):
            if entry.rpartition(".")[2] in GPU_NAMES:
                folder = os.path.join(base, entry)
                if os.path.exists(os.path.join(folder, "cur_freq")):
                    gpus.append((folder, entry))
        return cls(gpus) if gpus else None

    def read(self, out: list[f.Sample]) -> None:
        for folder, gpu in self.gpus:
            load = read_int(folder + "/device/load")
            if load is not None:
                out.append(f.Sample(f.GPU_UTILIZATION, (gpu,), min(load, 1000) / 1000))
            cur = read_int(folder + "/cur_freq")
            if cur is not None:
                out.append(f.Sample(f.GPU_FREQUENCY, (gpu,), float(cur)))
            limit = read_int(folder + "/max_freq")
            if limit is not None:
                out.append(f.Sample(f.GPU_FREQUENCY_LIMIT, (gpu,), float(limit)))

    def describe(self) -> str:
        return "GPU devfreq (" + ", ".join(g for _, g in self.gpus) + ")"


class Emc:
    name = "emc"

    def __init__(self, rate: str | None, cap: str | None) -> None:
        self.rate, self.cap = rate, cap

    @classmethod
    def discover(cls, root: str) -> Emc | None:
        rate = os.path.join(root, EMC_RATE)
        cap = os.path.join(root, EMC_CAP)
        found = cls(
            rate if read_int(rate) is not None else None,
            cap if read_int(cap) is not None else None,
        )
        return found if found.rate or found.cap else None

    def read(self, out: list[f.Sample]) -> None:
        if self.rate and (value := read_int(self.rate)) is not None:
            out.append(f.Sample(f.EMC_FREQUENCY, ("bpmp",), float(value)))
        if self.cap and (value := read_int(self.cap)) is not None:
            out.append(f.Sample(f.EMC_FREQUENCY_LIMIT, ("nvpmodel",), float(value)))

    def describe(self) -> str:
        return "EMC " + " and ".join(
            what for what, path in (("clock", self.rate), ("cap", self.cap)) if path
        )


def power_mode_names(conf_text: str) -> dict[int, str]:
    return {int(i): name for i, name in _MODEL.findall(conf_text)}


class PowerMode:
    name = "nvpmodel"

    def __init__(self, status: str, names: dict[int, str]) -> None:
        self.status, self.names = status, names

    @classmethod
    def discover(cls, root: str) -> PowerMode | None:
        status = os.path.join(root, NVPMODEL_STATUS)
        if read_text(status) is None:
            return None
        conf = read_text(os.path.join(root, NVPMODEL_CONF)) or ""
        return cls(status, power_mode_names(conf))

    def current(self) -> tuple[int, str] | None:
        match = _PMODE.search(read_text(self.status) or "")
        if match is None:
            return None
        mode = int(match.group(1))
        return mode, self.names.get(mode, "")

    def read(self, out: list[f.Sample]) -> None:
        now = self.current()
        if now is not None:
            out.append(f.Sample(f.POWER_MODE, (str(now[0]), now[1]), 1.0))

    def describe(self) -> str:
        now = self.current()
        if now is None:
            return "power mode: unknown"
        return f"power mode {now[1] or '?'} (id {now[0]})"
