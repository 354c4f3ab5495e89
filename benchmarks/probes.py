"""What benchmarks read off a server they run: a free loopback port, a process's CPU
time, and how many requests a model answered (from the statistics extension).
Next to the scripts, like ``machine.py``."""

from __future__ import annotations

import json
import os
import socket
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
