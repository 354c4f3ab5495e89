"""The Markdown report of ``bench_triton.py``: every server side by side, each Triton
named with the backend that ran the models; next to the scripts, like ``machine.py``."""

from __future__ import annotations

import datetime
import statistics
import sys
from pathlib import Path
from typing import Any

import triton_layout

# the servers a run can measure, in report order, with the backend that runs the models
LABELS = {
    "triton-ort": "Triton (native ONNX Runtime backend)",
    "triton": "Triton (Python backend)",
    "appliance": "appliance",
    "floor": "Python floor (floor_server.py)",
}


def report(
    machine: dict[str, str],
    results: dict[tuple[str, str, int], list[dict[str, Any]]],
    args: Any,
    pa: list[str],
    idle: dict[str, tuple[float, float]],
) -> str:
    """``idle``: per server, (seconds from start to ready, RSS MiB of its process tree
    at idle)."""
    names = [n for n in LABELS if any(r["server"] == n for rows in results.values() for r in rows)]
    tritons = [n for n in names if n != "appliance"]  # the ratios' denominators
    native = (
        f"the same tritonserver 2.51 with `libtriton_onnxruntime.so` from "
        f"`{args.triton_backend_dir}` (built by the user from Triton's onnxruntime_backend "
        "sources), platform onnxruntime_onnx"
        if args.triton_backend_dir
        else "not measured (`--triton-backend-dir` not given)"
    )
    lines = [
        f"# The appliance against Triton 2.51 ({datetime.date.today()}) {args.label}".rstrip(),
        "",
        "`python benchmarks/bench_triton.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in machine.items()],
        f"| perf_analyzer | `{Path(pa[-1]).name}` ({triton_layout.PERF_ANALYZER}) |",
        f"| Triton (Python backend) | {triton_layout.PYTRITON} (tritonserver 2.51): a "
        "Python-backend model running the ONNX file with ONNX Runtime in-process |",
        f"| Triton (native ONNX Runtime backend) | {native} |",
        f"| models | max_batch_size 8, dynamic batching, {args.queue_delay_us} us queue delay, "
        f"1 instance, {args.threads} ONNX Runtime thread(s); batch 1 per request |",
        "",
        "| server | start-up to ready (s) | idle RSS of its process tree (MiB) |",
        "|---|---|---|",
        *[f"| {LABELS[n]} | {idle[n][0]:.2f} | {idle[n][1]:.0f} |" for n in names if n in idle],
        "",
        "Medians over the runs of each point (every run is listed below). Each server's "
        "cell: infer/s, p50 ms, p99 ms, server CPU ms per request (utime+stime of its "
        "process tree), batch (inferences per execution). Ratios: appliance infer/s over "
        "each other server's. The Python floor (`floor_server.py`: the least a Python "
        "server on this stack does per request, HTTP only) shows what Python itself costs "
        "on this path. Others: the load of every other process on the machine during the "
        "runs, in cores.",
        "",
        "| model / protocol / concurrency | "
        + " | ".join(LABELS[n] for n in names)
        + "".join(f" | appliance / {LABELS[t]}" for t in tritons if "appliance" in names)
        + " | others (cores) |",
        "|---|" + "---|" * (len(names) + (len(tritons) if "appliance" in names else 0) + 1),
    ]

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows) if rows else float("nan")

    for (model, protocol, c), rows in results.items():
        cells = []
        by = {}
        for name in names:
            mine = [r for r in rows if r["server"] == name]
            by[name] = med(mine, "infer_s")
            cells.append(
                "-" if not mine else
                f"{med(mine, 'infer_s'):,.0f}, {med(mine, 'p50_ms'):.2f}, "
                f"{med(mine, 'p99_ms'):.2f}, {med(mine, 'cpu_ms'):.3f}, {med(mine, 'batch'):.2f}"
            )  # fmt: skip
        if "appliance" in names:
            cells += [f"{by['appliance'] / by[t]:.2f}" if by[t] > 0 else "-" for t in tritons]
        others = max(r["others_cores"] for r in rows)
        lines.append(
            f"| {model}, {protocol.upper() if protocol == 'http' else 'gRPC'}, {c} "
            f"| {' | '.join(cells)} | {others:.2f} |"
        )
    lines += [
        "",
        "Every run, in the order taken:",
        "",
        "| point | server | infer/s | p50 ms | p99 ms | CPU ms/req | client CPU ms/req | batch "
        "| others (cores) | load average |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (model, protocol, c), rows in results.items():
        for r in rows:
            lines.append(
                f"| {model} {protocol} c={c} | {LABELS[r['server']]} | {r['infer_s']:,.0f} | "
                f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['cpu_ms']:.3f} | "
                f"{r['client_ms']:.3f} | {r['batch']:.2f} | "
                f"{r['others_cores']:.2f} | {r['uptime']} |"
            )
    return "\n".join(lines) + "\n"
