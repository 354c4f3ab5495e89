"""What benchmarks read off a server they run: a free loopback port, a process's CPU
time, and how many requests a model answered (from the statistics extension); and the
environment that runs a checkout as an installed copy runs. Next to the scripts, like
``machine.py``."""

from __future__ import annotations

import compileall
import json
import os
import socket
import sys
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def successes(http: str, model: str) -> int:
    """Requests ``model`` answered with success on the server at ``http`` (host:port)."""
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=10) as r:
        rows = json.load(r)["model_stats"]
    return sum(int(row["inference_stats"]["success"]["count"]) for row in rows)


def installed_env(root: Path) -> dict[str, str]:
    """The environment for running the checkout at ``root`` as a device runs the
    installed package: its modules' bytecode compiled ahead (pip compiles a wheel's
    modules at install time), so start-up is not charged compiling ~140 modules from
    source, which a ``PYTHONDONTWRITEBYTECODE`` environment (or a read-only checkout)
    would otherwise make it pay at every start. The bytecode goes to a cache folder
    (``PYTHONPYCACHEPREFIX``), not into the checkout."""
    cache = os.environ.get("APPLIANCE_BENCH_CACHE", Path.home() / ".cache" / "appliance-bench")
    prefix = Path(cache) / "pycache"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(prefix)
    env["PYTHONPATH"] = str(root)
    sys_prefix, sys.pycache_prefix = sys.pycache_prefix, str(prefix)
    try:
        compileall.compile_dir(root / "appliance", quiet=1)
    finally:
        sys.pycache_prefix = sys_prefix
    return env
