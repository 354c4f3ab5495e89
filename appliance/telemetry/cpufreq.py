"""CPU frequency per cpufreq policy (``/sys/devices/system/cpu/cpufreq/policy*``).

A policy is a group of CPUs that share a clock (one per cluster on a Jetson Orin, one
per CPU on most PCs). ``scaling_cur_freq`` is the clock now, ``scaling_max_freq`` the
highest it may reach now (a power mode or thermal capping lowers it),
``cpuinfo_max_freq`` what the hardware can do; all in kHz, exposed in hertz.
"""

from __future__ import annotations

import os

from appliance.telemetry import families as f
from appliance.telemetry.files import cpu_list, listdir, read_int, read_text


class CpuFrequency:
    name = "cpufreq"

    def __init__(self, policies: list[tuple[str, tuple[str, str], float | None]]) -> None:
        # (policy folder, (policy, cpus) labels, cpuinfo_max_freq in Hz)
        self.policies = policies

    @classmethod
    def discover(cls, root: str) -> CpuFrequency | None:
        base = os.path.join(root, "sys/devices/system/cpu/cpufreq")
        policies = []
        for entry in listdir(base):
            folder = os.path.join(base, entry)
            if not entry.startswith("policy") or not os.path.exists(
                os.path.join(folder, "scaling_cur_freq")
            ):
                continue
            cpus_text = read_text(os.path.join(folder, "affected_cpus")) or ""
            try:
                cpus = cpu_list([int(c) for c in cpus_text.split()])
            except ValueError:
                cpus = cpus_text
            hw_max = read_int(os.path.join(folder, "cpuinfo_max_freq"))
            labels = (entry[len("policy") :], cpus)
            policies.append((folder, labels, None if hw_max is None else hw_max * 1000.0))
        return cls(policies) if policies else None

    def read(self, out: list[f.Sample]) -> None:
        for folder, labels, hw_max in self.policies:
            cur = read_int(folder + "/scaling_cur_freq")
            if cur is not None:
                out.append(f.Sample(f.CPU_FREQUENCY, labels, cur * 1000.0))
            limit = read_int(folder + "/scaling_max_freq")
            if limit is not None:
                out.append(f.Sample(f.CPU_FREQUENCY_LIMIT, labels, limit * 1000.0))
            if hw_max is not None:
                out.append(f.Sample(f.CPU_FREQUENCY_MAX, labels, hw_max))

    def describe(self) -> str:
        return f"cpufreq ({len(self.policies)} policies)"
