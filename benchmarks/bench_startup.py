"""Start-up to ready, idle memory and the import bill of ``appliance serve``.

    python3 benchmarks/bench_startup.py [--root CHECKOUT] [--runs 5] [--out FILE.md]
                                        [-- SERVE_ARGS...]

Runs ``python -m appliance serve`` from ``--root`` (default: this checkout; another
checkout measures a before/after) with the demo models on free loopback ports, plus
any ``SERVE_ARGS`` (e.g. ``--grpc-port -1 --metrics-port -1``), and reports:

- start-up to ready: from process start until ``/v2/health/ready`` answers 200
  (median and range of ``--runs``);
- idle RSS (VmRSS) 3 s after ready, with no traffic;
- the Python heap at ready by package (``tracemalloc``, a separate run: tracing
  slows every allocation, so its run is not timed), each block counted to the
  package whose code allocated it (its innermost frame outside the import machinery:
  a module's code objects count to the package that imported it);
- the import bill (``python -X importtime``, a separate run): the self time of
  every module, summed by top-level package, most expensive first.

Figures depend on the machine and its load (the load average is written down with
them): they are recorded, never asserted.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from probes import installed_env

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20

# on "ready in": the Python heap by top-level package, then stop (a -c script)
HEAP_PROBE = """
import collections, logging, os, signal, sys, tracemalloc
class Probe(logging.Handler):
    def emit(self, record):
        if not record.getMessage().startswith("ready in"):
            return
        by = collections.Counter()
        for stat in tracemalloc.take_snapshot().statistics("traceback"):
            # the innermost frame that is not the import machinery: the code that ran
            path = next((f.filename for f in reversed(stat.traceback)
                         if not f.filename.startswith("<frozen")), "?")
            m = __import__("re").search(r"(?:site|dist)-packages/([^/]+)", path)
            name = m.group(1) if m else ("appliance" if "/appliance/" in path else "stdlib")
            by[name.split(".")[0]] += stat.size
        for name, size in by.most_common(12):
            print(f"HEAP {name} {size}", flush=True)
        print(f"HEAP total {tracemalloc.get_traced_memory()[0]}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
logging.getLogger("appliance.server").addHandler(Probe())
sys.argv = ["appliance", *sys.argv[1:]]
from appliance.cli import main
sys.exit(main())
"""


def _start(root: Path, serve_args: list[str], prefix: list[str]) -> subprocess.Popen[str]:
    env = installed_env(root)
    args = ["serve", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    return subprocess.Popen(
        [sys.executable, *prefix, *args, *serve_args],
        cwd=root,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _port(proc: subprocess.Popen[str], lines: list[str]) -> int:
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"listening: https?://[^:]+:(\d+)", line)
        if m:
            return int(m.group(1))
    raise RuntimeError("the server did not start:\n" + "".join(lines))


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return out + err


def one_start(root: Path, serve_args: list[str]) -> tuple[float, int]:
    """Seconds from process start to ready; VmRSS bytes 3 s after ready."""
    t0 = time.perf_counter()
    proc = _start(root, serve_args, ["-m", "appliance"])
    try:
        port = _port(proc, [])
        for _ in range(6000):  # bounded: 60 s
            try:
                url = f"http://127.0.0.1:{port}/v2/health/ready"
                if urllib.request.urlopen(url, timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.01)
        ready = time.perf_counter() - t0
        time.sleep(3.0)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
        return ready, rss
    finally:
        _stop(proc)


def heap(root: Path, serve_args: list[str]) -> list[tuple[str, int]]:
    proc = _start(root, serve_args, ["-X", "tracemalloc=64", "-c", HEAP_PROBE])
    out, err = proc.communicate(timeout=120)
    rows = [line.split() for line in out.splitlines() if line.startswith("HEAP ")]
    if not rows:
        raise RuntimeError("no heap figures:\n" + err)
    return [(name, int(size)) for _, name, size in rows]


def imports(root: Path, serve_args: list[str]) -> list[tuple[str, int]]:
    """Import microseconds per top-level package: the self time of its every module."""
    proc = _start(root, serve_args, ["-X", "importtime", "-m", "appliance"])
    lines: list[str] = []
    _port(proc, lines)
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if "ready in" in line or "NOT ready" in line:
            break
    lines.append(_stop(proc))
    by: collections.Counter[str] = collections.Counter()
    for line in "".join(lines).splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \| +(\S+)", line)
        if m:
            by[m.group(2).split(".")[0]] += int(m.group(1))
    return by.most_common()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to run")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, help="append the report to this file")
    parser.add_argument("serve_args", nargs="*", help="after --: more `appliance serve` options")
    a = parser.parse_args()
    root = a.root.resolve()
    load = os.getloadavg()
    starts = [one_start(root, a.serve_args) for _ in range(a.runs)]
    ready = sorted(s for s, _ in starts)
    rss = sorted(r for _, r in starts)
    report = [
        f"### `{root.name}` serve {' '.join(a.serve_args) or '(HTTP, gRPC, metrics)'}",
        "",
        f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {a.runs} runs",
        "",
        f"- start-up to ready: median {statistics.median(ready):.2f} s "
        f"({ready[0]:.2f}-{ready[-1]:.2f})",
        f"- idle RSS 3 s after ready: median {statistics.median(rss) / MiB:.1f} MiB "
        f"({rss[0] / MiB:.1f}-{rss[-1] / MiB:.1f})",
        "",
        "| package | import ms (self time of its modules) |",
        "|---|---|",
        *(f"| {name} | {us / 1000:.1f} |" for name, us in imports(root, a.serve_args)[:16]),
        "",
        "| package | Python heap at ready, KiB (tracemalloc) |",
        "|---|---|",
        *(f"| {name} | {size / 1024:.0f} |" for name, size in heap(root, a.serve_args)),
        "",
    ]
    text = "\n".join(report)
    print(text)
    if a.out is not None:
        with a.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
