"""What a benchmark ran on: CPU, cores, memory, OS, Python and package versions.

Every benchmark report starts with this table, so figures always travel with the
machine that produced them. Run as scripts, the benchmarks find this module next
to them (``python benchmarks/bench_x.py`` puts ``benchmarks/`` on ``sys.path``).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

_ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "asimd", "sve")


def _cpuinfo(key: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def describe(*packages: str) -> dict[str, str]:
    """Rows for the report's machine table; ``packages`` adds their installed versions."""
    flags = set((_cpuinfo("flags") or _cpuinfo("Features")).split())
    isa = ", ".join(x for x in _ISA if x in flags)
    cpu = _cpuinfo("model name") or platform.processor() or platform.machine()
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    info = {
        "CPU": f"{cpu} ({isa})" if isa else cpu,
        "cores (usable)": f"{len(os.sched_getaffinity(0))} (of {os.cpu_count()})",
        "RAM": f"{mem / 2**30:.1f} GiB",
        "OS": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "Python": platform.python_version(),
    }
    for name in packages:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = "not installed"
    info["load average before run (1/5/15 min)"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return info
