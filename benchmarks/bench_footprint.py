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
  200, and the resident memory 3 s after that with no traffic, with where it lies
  (``/proc/PID/smaps``: anonymous memory, the heap, each library's pages);
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


FLOOR_IMPORTS = "import asyncio, numpy, onnxruntime, orjson, uvloop"
SERVING_IMPORTS = "import appliance.cli, appliance.server, appliance.backends.onnxruntime_backend"


ANONYMOUS = "anonymous (Python's objects and code, ONNX Runtime's buffers, thread stacks)"


def rss_by_mapping(pid: int) -> dict[str, int]:
    """Where ``pid``'s resident memory lies: resident bytes for each kind of mapping
    (anonymous, the heap, each mapped file by name). A file's pages are its code and
    data: the clean ones are shared with every process that maps the file, and the
    kernel may drop them under pressure (read again when used)."""
    groups: dict[str, int] = {}
    current = ANONYMOUS
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's first line
            name = fields[5] if len(fields) > 5 else ""
            current = ANONYMOUS if not name or name.startswith("[anon") else Path(name).name
        elif fields[0] == "Rss:":
            groups[current] = groups.get(current, 0) + int(fields[1]) * 1024
    return groups


def cold_start(venv: Path, grpc: bool) -> tuple[float, int, float, dict[str, int]]:
    """Seconds from process start to ready, idle RSS 3 s later (bytes), the server's
    own start-up figure from its log (listening to ready, imports excluded), and where
    that memory lies (:func:`rss_by_mapping`).
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
        rss, where = _rss(proc.pid), rss_by_mapping(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    own = re.search(r"ready in ([0-9.]+)s", log.read_text())
    return elapsed, rss, float(own.group(1)) if own else float("nan"), where


def slow_imports(venv: Path, top: int = 12) -> list[tuple[int, str]]:
    """The serving path's slowest imports (cumulative microseconds)."""
    err = _run([str(venv / "bin" / "python"), "-X", "importtime", "-c", SERVING_IMPORTS]).stderr
    rows = []
    for line in err.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    return sorted(rows, reverse=True)[:top]


def python_objects(venv: Path, probe: str) -> int:
    """Bytes in Python's small-object arenas (its objects, module code included)
    once ``probe`` ran: what importing those modules keeps resident, however loaded."""
    code = f"{probe}; import sys; sys._debugmallocstats()"
    err = _run([str(venv / "bin" / "python"), "-c", code]).stderr
    arenas = re.search(r"# arenas allocated current\s*=\s*([0-9,]+)", err)
    size = re.search(r"([0-9,]+) arenas \* ([0-9,]+) bytes/arena", err)
    if not arenas or not size:
        return 0
    return int(arenas.group(1).replace(",", "")) * int(size.group(2).replace(",", ""))


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
        objects = {p: python_objects(venv, p) for p in ("pass", FLOOR_IMPORTS, SERVING_IMPORTS)}
        versions = _run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"])
    counted = {k: v for k, v in per_dist.items() if k not in EXCLUDED}
    total = sum(counted.values())
    times = [t for t, _, _, _ in starts]
    rss = [r for _, r, _, _ in starts]
    own = [o for _, _, o, _ in starts]
    where = sorted(starts, key=lambda s: s[1])[len(starts) // 2][3]  # the median start's
    ranked = sorted(where.items(), key=lambda kv: -kv[1])
    shown, rest = ranked[:10], [size for _, size in ranked[10:]]
    spec = "pip install ." + (f"[{args.extras}]" if args.extras else "")
    if args.constraints:
        spec += f" -c {args.constraints}"
    lines = [
        f"# Footprint of a fresh install, {datetime.date.today()}",
        "",
        "```",
        "python3 benchmarks/bench_footprint.py " + " ".join(_without_out(sys.argv[1:])),
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
        "Where the median start's idle memory lies (`/proc/PID/smaps`; a library's "
        "pages are its code and data, the clean ones shared with any process mapping it):",
        "",
        "| mapping | resident MiB |",
        "|---|---:|",
        *(f"| {name} | {size / MiB:.1f} |" for name, size in shown),
        f"| {len(rest)} other mappings | {sum(rest) / MiB:.1f} |",
        "",
        "Python's small-object arenas (its objects, module code included) after "
        "importing (`sys._debugmallocstats`):",
        "",
        "| imports | MiB |",
        "|---|---:|",
        *(f"| `{probe}` | {size / MiB:.1f} |" for probe, size in objects.items()),
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
