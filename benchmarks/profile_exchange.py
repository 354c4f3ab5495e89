"""What one small request costs inside the server, counted in calls, not seconds.

    python3 benchmarks/profile_exchange.py [--requests 2000] [--binary] [--top 30]

Starts the appliance in this process (the demo models, no listening endpoint), then
sends ``--requests`` HTTP inference requests of Triton's ``simple`` (two INT32 [1, 16]
inputs; JSON numbers, or binary tensors with ``--binary``) one after another through
the one inference exchange, as the HTTP front does once it has a request's body
(:func:`appliance.adapters.http.infer.answer`: admission ticket, form (or the plan of a
plain binary request), declare, build, data plane, dynamic batcher, the instance's
thread, encoder). A profile hook installed before the server starts, so that the
instance threads carry it, counts every Python function call and every call into C
made during those requests, per thread: the event loop's, the instances', any other.
Counts do not depend on the machine's load, unlike times: they say how much work a
request is and where, and a change to the request path shows up as a change of
counts. The thread hand-offs per request are counted apart (the loop handing the
request to an instance thread, the thread handing the answer back).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "appliance" / "demo_models"
sys.path.insert(0, str(ROOT))

from appliance.adapters.http import infer  # noqa: E402
from appliance.config.server_config import load_server_config  # noqa: E402
from appliance.server import Server  # noqa: E402

# C calls that move a request between threads
HAND_OFFS = (
    "Condition.notify",
    "Condition.wait",
    "call_soon_threadsafe",
    "_write_to_self",
    "lock.acquire",
    "Future.set_result",
    "run_in_executor",
)

timed: list[tuple[float, float]] = []  # (wall, CPU) µs per request, --no-count
counts: collections.Counter[tuple[str, str]] = collections.Counter()
counting = False


def _where(code: Any) -> str:
    path = Path(code.co_filename)
    parts = path.parts
    for root in ("appliance", "asyncio", "concurrent", "threading.py"):
        if root in parts or path.name == root:
            index = parts.index(root) if root in parts else len(parts) - 1
            return "/".join(parts[index:])
    return path.name


def _hook(frame: FrameType, event: str, arg: Any) -> None:
    if not counting:
        return
    kind = "loop" if threading.current_thread() is threading.main_thread() else "thread"
    if event == "call":
        code = frame.f_code
        counts[(kind, f"{_where(code)}:{getattr(code, 'co_qualname', code.co_name)}")] += 1
    elif event == "c_call":
        counts[(kind, f"<C> {getattr(arg, '__qualname__', repr(arg))}")] += 1


async def run(requests: int, model: str, delay_us: int | None = None, binary: bool = False) -> None:
    global counting
    options: dict[str, Any] = {"http_port": -1, "grpc_port": -1, "metrics_port": -1}
    if delay_us is not None:  # the demo model, with another queue delay
        repo = Path(tempfile.mkdtemp())
        shutil.copytree(DEMO / model, repo / model)
        text = (repo / model / "config.yaml").read_text()
        delay = f"max_queue_delay_microseconds: {delay_us}"
        text = re.sub(r"max_queue_delay_microseconds: \d+", delay, text)
        (repo / model / "config.yaml").write_text(text)
        options["model_repository"] = repo
    config = load_server_config(None, options)
    server = Server(config)
    await server.start()
    field = None
    if binary:  # Triton's binary tensor extension, as tritonclient and perf_analyzer send
        data = bytes(64)
        header = json.dumps(
            {
                "inputs": [
                    {"name": n, "datatype": "INT32", "shape": [1, 16],
                     "parameters": {"binary_data_size": len(data)}}
                    for n in ("INPUT0", "INPUT1")
                ],
                "outputs": [{"name": n, "parameters": {"binary_data": True}}
                            for n in ("OUTPUT0", "OUTPUT1")],
            }
        ).encode()  # fmt: skip
        body, field = header + data + data, str(len(header))
    else:
        body = json.dumps(
            {
                "inputs": [
                    {"name": n, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
                    for n in ("INPUT0", "INPUT1")
                ]
            }
        ).encode()
    dp = server.dataplane
    started = [0.0, 0.0]

    async def one() -> None:
        ticket = dp.admit(model, "", len(body))
        try:
            await infer.answer(dp, ticket, model, "", body, field)
        finally:
            ticket.release()

    try:
        for _ in range(200):  # warm: first-call caches, the batcher's steady state
            await one()
        counting = True
        started[:] = [time.perf_counter(), time.process_time()]
        for _ in range(requests):
            await one()
        counting = False
        wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
        timed.append((wall / requests * 1e6, cpu / requests * 1e6))
    finally:
        await server.stop()


def report(requests: int, top: int) -> str:
    per = {k: v / requests for k, v in counts.items()}
    loop_py = sum(v for (k, f), v in per.items() if k == "loop" and not f.startswith("<C>"))
    loop_c = sum(v for (k, f), v in per.items() if k == "loop" and f.startswith("<C>"))
    thr_py = sum(v for (k, f), v in per.items() if k == "thread" and not f.startswith("<C>"))
    thr_c = sum(v for (k, f), v in per.items() if k == "thread" and f.startswith("<C>"))
    lines = [
        f"{requests} requests of `simple` through the exchange (HTTP wire), counted per "
        "request:",
        "",
        "| thread | Python calls | C calls |",
        "|---|---|---|",
        f"| event loop | {loop_py:.1f} | {loop_c:.1f} |",
        f"| instance and worker threads | {thr_py:.1f} | {thr_c:.1f} |",
        "",
        "Hand-off primitives per request:",
        "",
        "| call | event loop | threads |",
        "|---|---|---|",
    ]
    for name in HAND_OFFS:
        got = [
            sum(v for (k, f), v in per.items() if k == kind and f.endswith(name))
            for kind in ("loop", "thread")
        ]
        lines.append(f"| `{name}` | {got[0]:.2f} | {got[1]:.2f} |")
    lines += ["", f"The {top} most called, per request:", "", "| thread | function | calls |"]
    lines.append("|---|---|---|")
    for (kind, name), v in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {kind} | `{name}` | {v:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--model", default="simple")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument(
        "--queue-delay-us",
        type=int,
        help="serve the model with this dynamic-batching queue delay (0: a lone request "
        "is sent at once, and a cheap model runs it on the event loop)",
    )
    ap.add_argument(
        "--no-count",
        action="store_true",
        help="no profile hook: the bare loop, timed (wall and CPU per request), and for "
        "an instruction counter around it (valgrind --tool=callgrind; the difference of "
        "two --requests gives a request's)",
    )
    ap.add_argument(
        "--binary",
        action="store_true",
        help="binary tensors (Triton's extension, as perf_analyzer and tritonclient send "
        "them) instead of JSON numbers",
    )
    a = ap.parse_args()
    if a.no_count:
        asyncio.run(run(a.requests, a.model, a.queue_delay_us, a.binary))
        wall, cpu = timed[0]
        print(f"{wall:.1f} us wall, {cpu:.1f} us CPU (the whole process) per request")
        return
    threading.setprofile(_hook)  # threads started from now on: the instances'
    sys.setprofile(_hook)
    try:
        asyncio.run(run(a.requests, a.model, a.queue_delay_us, a.binary))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    print(report(a.requests, a.top))


if __name__ == "__main__":
    main()
