"""The real ``appliance serve`` command in a subprocess, on free loopback ports: the
tests that need a whole process (signals, exit codes) start it here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from pace import scaled

ROOT = Path(__file__).resolve().parent.parent


def start_serve(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[subprocess.Popen[str], int, list[str]]:
    """Start ``appliance serve`` with HTTP, gRPC and metrics on free ports (``args`` may
    turn one off or add others; ``env``: its environment, default this one's); wait
    until ready. Returns the process, its HTTP port, and its log lines (still growing,
    read by a thread). ``cwd``: its working directory (this checkout stays importable
    from there)."""
    base = os.environ if env is None else env
    path = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "appliance", "serve"),
            *("--http-port", "0", "--metrics-port", "0", "--grpc-port", "0", *args),
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**base, "PYTHONPATH": path},
    )
    lines: list[str] = []
    port_found = threading.Event()
    port: list[int] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"listening: http://127\.0\.0\.1:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
                port_found.set()

    threading.Thread(target=read, daemon=True).start()
    if not port_found.wait(scaled(60)):
        proc.kill()
        raise AssertionError("the server did not start:\n" + "".join(lines))
    for _ in range(int(scaled(600))):  # ready once the models loaded (bounded: 60 s)
        if any("NOT ready" in line for line in lines):
            break  # started, with a model that did not load: ready it will not be
        try:
            url = f"http://127.0.0.1:{port[0]}/v2/health/ready"
            if urllib.request.urlopen(url, timeout=5).status == 200:
                break
        except OSError:
            time.sleep(0.1)
    return proc, port[0], lines


def startup_lines(proc: subprocess.Popen[str]) -> list[str]:
    """The log of an ``appliance serve`` started with stderr piped, read up to its
    "ready in" or "NOT ready" line (bounded by the server's own start-up)."""
    lines: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if "ready in" in line or "NOT ready" in line:
            break
    return lines
