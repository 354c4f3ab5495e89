"""What the gRPC endpoint's own HTTP/2 layer costs per call, before/after on two trees.

A benchmark, not a test. It isolates what served traffic pays in the HTTP/2 and gRPC
call layers (``grpc_h2.Connection`` and ``dispatch.Dispatcher``, frames, HPACK,
flow control, the limits' bookkeeping) from the model, the data plane and the client:
one process per tree and run feeds a real ``Connection`` the bytes a well-behaved
client sends for ``--calls`` unary calls (``--batch`` calls per read, as
``--batch`` outstanding calls would arrive; headers HPACK-indexed as a real client
sends them; messages of ``--size`` bytes split into 16 KiB DATA frames), served by an
echo method, and writes into an in-memory transport. The figure is the process's CPU
time per call (``time.process_time``: other processes on the machine move it far
less than wall time). ``--baseline DIR`` is another copy of the project (``git
archive <commit> | tar -x -C DIR``); the trees alternate ``--repeats`` times. Bounded:
at most ``--calls`` calls per run (20,000 by default; a run takes well under a
second per 10,000 small calls). Markdown rows on stdout::

    python3 benchmarks/bench_grpc_h2.py --baseline /tmp/base --size 100 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
MAX_WINDOW = 2**31 - 1


def _frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    head = struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", sid)
    return head + payload


class _Transport:
    """The part of an asyncio transport a Connection uses; it counts what is written."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: Any) -> None:
        self.written += len(data)

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.written += len(chunk)

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int = 0, low: int = 0) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        pass

    abort = close
    pause_reading = resume_reading = close


def _client_bytes(calls: int, batch: int, size: int) -> list[bytes]:
    """What a client sends: the preface and its SETTINGS (a window that never blocks the
    answers), then one chunk per ``batch`` calls, each chunk ending with the connection
    WINDOW_UPDATE that gives back what the previous chunk's answers used."""
    import hpack

    encoder = hpack.Encoder()
    fields = [(":method", "POST"), (":scheme", "http"), (":path", "/b.S/Echo"),
              (":authority", "127.0.0.1"), ("te", "trailers"),
              ("content-type", "application/grpc")]  # fmt: skip
    message = struct.pack(">BI", 0, size) + bytes(size)
    pieces = range(0, len(message), 16384)
    start = (
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + _frame(4, 0, 0, struct.pack(">HI", 4, MAX_WINDOW))
        + _frame(4, 1, 0)  # the ACK of the server's SETTINGS
        + _frame(8, 0, 0, struct.pack(">I", MAX_WINDOW - 65535))
    )
    refill = _frame(8, 0, 0, struct.pack(">I", batch * len(message)))
    chunks, sid = [start], 1
    for first in range(0, calls, batch):
        chunk = bytearray(refill if first else b"")
        for _ in range(min(batch, calls - first)):
            block = encoder.encode(fields)
            chunk += _frame(1, 4, sid, block)
            for i in pieces:
                last = i + 16384 >= len(message)
                chunk += _frame(0, 1 if last else 0, sid, message[i : i + 16384])
            sid += 2
        chunks.append(bytes(chunk))
    return chunks


async def _child(calls: int, batch: int, size: int) -> tuple[float, float]:
    from appliance.adapters.grpc import calls as grpc_calls
    from appliance.adapters.grpc import dispatch
    from appliance.adapters.grpc.h2.connection import Connection

    async def echo(request: bytes, context: object) -> bytes:
        return request

    methods = {"/b.S/Echo": grpc_calls.Method(grpc_calls.UNARY, echo, bytes, bytes)}
    chunks = _client_bytes(calls, batch, size)
    conn = Connection(dispatch.Dispatcher(methods), size + 1024, lambda c: None)
    transport = _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(chunks[0])
    begin = time.process_time()
    for chunk in chunks[1:]:
        conn.data_received(chunk)
        while conn.calls:
            await asyncio.gather(*list(conn.calls))
        if conn.transport is None:
            raise SystemExit("the server closed the connection: the bench's bytes are wrong")
    spent = time.process_time() - begin
    conn.close()
    return spent * 1e6 / calls, transport.written / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="the other source tree")
    ap.add_argument("--calls", type=int, default=20000, help="calls per run (at most 10^6)")
    ap.add_argument("--batch", type=int, default=8, help="calls per read")
    ap.add_argument("--size", type=int, default=100, help="message bytes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    calls = max(1, min(a.calls, 10**6))
    if a.child:
        print(*asyncio.run(_child(calls, a.batch, a.size)))
        return 0
    trees = [("baseline", a.baseline.resolve())] if a.baseline else []
    trees.append(("this tree", HERE))
    results: dict[str, list[float]] = {name: [] for name, _ in trees}
    print(f"{calls} calls of {a.size} B, {a.batch} per read")
    print("\n| repeat | tree | CPU us/call | bytes written/call |\n|---|---|---|---|")
    for rep in range(a.repeats):
        for name, tree in trees:
            cmd = [sys.executable, __file__, "--child", "--calls", str(calls),
                   "--batch", str(a.batch), "--size", str(a.size)]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run(cmd, env=env, cwd=tree, check=True, timeout=600,
                                 capture_output=True, text=True)  # fmt: skip
            cpu, written = (float(x) for x in out.stdout.split()[-2:])
            results[name].append(cpu)
            print(f"| {rep + 1} | {name} | {cpu:.1f} | {written:.0f} |", flush=True)
    for name, values in results.items():
        print(f"| median (min) | {name} | {statistics.median(values):.1f} ({min(values):.1f}) | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
