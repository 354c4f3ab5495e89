"""Install footprint, cold start to READY and idle RSS of a fresh install.

    python3 benchmarks/bench_footprint.py [--extras grpc,uvloop] [--constraints constraints.txt]
                                          [--runs 5] [--out benchmarks/results/DATE-footprint.md]

Builds a new virtual environment under the temporary directory, installs this
checkout into it as a user would (``pip install .``, from a copy of the tree so
the checkout stays untouched), then:

- sums the installed files of every distribution from its RECORD (what pip wrote,
  compiled ``.pyc`` included), leaving out pip and setuptools;
- starts ``python -m appliance serve`` (the demo models, free loopback ports) ``--runs``
  times and measures, from process start, the time until ``/v2/health/ready`` answers
  200, and the resident memory 3 s after that with no traffic;
- records the slowest imports of the serving path (``python -X importtime``).

Figures depend on the machine and its load: they are recorded, never asserted.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import http.client
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe  # benchmarks/machine.py, next to this script

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
EXCLUDED = {"pip", "setuptools", "wheel"}


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)  # type: ignore[call-overload,no-any-return]


def install(venv: Path, extras: str, constraints: Path | None) -> float:
    """A fresh venv with this checkout installed; returns the install time in seconds."""
    _run([sys.executable, "-m", "venv", str(venv)])
    src = venv.parent / "src"
    files = _run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    target = f"{src}[{extras}]" if extras else str(src)
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", target]
    if constraints is not None:
        cmd += ["-c", str(constraints.resolve())]
    started = time.perf_counter()
    _run(cmd)
    return time.perf_counter() - started


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def sizes(venv: Path) -> dict[str, int]:
    """Bytes per installed distribution, from the RECORD files pip wrote."""
    site = site_packages(venv)
    out: dict[str, int] = {}
    for record in site.glob("*.dist-info/RECORD"):
        name = record.parent.name.split("-")[0].lower().replace("_", "-")
        total = 0
        with record.open(newline="") as fh:
            for row in csv.reader(fh):
                path = (site / row[0]).resolve()
                if path.is_file():
                    total += path.stat().st_size
        out[name] = total
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cold_start(venv: Path, grpc: bool) -> tuple[float, int, float]:
    """Seconds from process start to ready, idle RSS 3 s later (bytes), and the
    server's own start-up figure from its log (listening to ready, imports excluded).
    ``grpc``: the gRPC endpoint on a free port (the install has the grpc extra); else
    off, as the default install turns it off (a port asked for would stop the start)."""
    http_port = _free_port()
    cmd = [str(venv / "bin" / "python"), "-m", "appliance", "serve", "--http-port", str(http_port)]
    cmd += ["--grpc-port", str(_free_port() if grpc else -1), "--metrics-port", str(_free_port())]
    started = time.perf_counter()
    log = venv.parent / "serve.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=venv.parent, stderr=sink)
    try:
        deadline = started + 60
        while not _ready(http_port):
            if proc.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"server did not become ready (exit {proc.returncode})")
            time.sleep(0.005)
        elapsed = time.perf_counter() - started
        time.sleep(3)
        rss = _rss(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    own = re.search(r"ready in ([0-9.]+)s", log.read_text())
    return elapsed, rss, float(own.group(1)) if own else float("nan")


def slow_imports(venv: Path, top: int = 12) -> list[tuple[int, str]]:
    """The serving path's slowest imports (cumulative microseconds)."""
    probe = "import appliance.cli, appliance.server, appliance.backends.onnxruntime_backend"
    err = _run([str(venv / "bin" / "python"), "-X", "importtime", "-c", probe]).stderr
    rows = []
    for line in err.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    return sorted(rows, reverse=True)[:top]


def _without_out(argv: list[str]) -> list[str]:
    """The command line to reproduce a run: without ``--out FILE`` / ``--out=FILE``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip or a.startswith("--out="):
            skip = False
            continue
        skip = a == "--out"
        if not skip:
            out.append(a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extras", default="", help="extras to install, e.g. grpc,uvloop")
    ap.add_argument("--constraints", type=Path, help="pip constraints file (constraints.txt)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="appliance-footprint-") as tmp:
        venv = Path(tmp) / "venv"
        install_s = install(venv, args.extras, args.constraints)
        per_dist = sizes(venv)
        grpc = "grpc" in args.extras.split(",") or "all" in args.extras.split(",")
        starts = [cold_start(venv, grpc) for _ in range(args.runs)]
        imports = slow_imports(venv)
        versions = _run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"])
    counted = {k: v for k, v in per_dist.items() if k not in EXCLUDED}
    total = sum(counted.values())
    times = [t for t, _, _ in starts]
    rss = [r for _, r, _ in starts]
    own = [o for _, _, o in starts]
    spec = "pip install ." + (f"[{args.extras}]" if args.extras else "")
    if args.constraints:
        spec += f" -c {args.constraints}"
    lines = [
        f"# Footprint of a fresh install, {datetime.date.today()}",
        "",
        "```",
        "python3 benchmarks/bench_footprint.py "
        + " ".join(_without_out(sys.argv[1:])),
        "```",
        "",
        "| machine | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in describe().items()),
        "",
        f"Install: `{spec}` into a new venv, {install_s:.1f} s.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| site-packages without pip/setuptools | {total / MiB:.1f} MiB |",
        f"| cold start to READY (demo models), median of {len(times)} | "
        f"{statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f}) |",
        f"| of which the server's own start-up (its log: listening -> ready), median | "
        f"{statistics.median(own):.2f} s |",
        f"| idle RSS 3 s after READY, median | {statistics.median(rss) / MiB:.1f} MiB |",
        "",
        "| distribution | MiB |",
        "|---|---:|",
        *(
            f"| {name} | {size / MiB:.1f} |"
            for name, size in sorted(counted.items(), key=lambda kv: -kv[1])
        ),
        "",
        "Slowest imports on the serving path (cumulative, `python -X importtime`):",
        "",
        "| module | ms |",
        "|---|---:|",
        *(f"| {name.strip()} | {us / 1000:.0f} |" for us, name in imports),
        "",
        "Versions installed:",
        "",
        "```",
        versions.stdout.strip(),
        "```",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    os.environ.pop("PYTHONPATH", None)  # measure the venv's install, not a checkout
    main()
