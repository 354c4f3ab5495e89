"""Coverage-guided fuzzing of the gRPC endpoint's HTTP/2 parser, HPACK path and gRPC
message handling with atheris (``pip install atheris``; not a dependency, and not run
by the test suite)::

    python3 devtools/fuzz_grpc.py h2 -max_total_time=600 -rss_limit_mb=2048
    python3 devtools/fuzz_grpc.py hpack -max_total_time=300

Bounded: without ``-max_total_time`` and ``-runs`` on the command line a session stops
after 300 seconds or 1,000,000 inputs, whichever comes first (about 55,000 ``h2`` inputs
and 140,000 ``hpack`` inputs in 40 s on one core of the 2-core machine of
benchmarks/README.md). Any other libFuzzer option passes through (a corpus folder, or
``-artifact_prefix=DIR/`` for where a failing input is written; the default is the
current folder).

``h2``: each input is the byte stream one client sends (after a valid preface and
SETTINGS, or raw when the first byte is odd), fed in pieces of varying size to a real
:class:`appliance.adapters.grpc.h2.connection.Connection` on an event loop, serving an echo method
(unary and streaming) through the real :class:`dispatch.Dispatcher`. It fails when
anything escapes the connection (an exception, an "unexpected error" logged: a bug),
or when what the server wrote is not well-formed HTTP/2: a frame longer than 16384
bytes, a frame type the server never sends, a header block HPACK cannot decode.
``hpack``: each input is one header block for :class:`headers.HeaderDecoder`,
which must return or raise ProtocolError(COMPRESSION_ERROR), nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import atheris

with atheris.instrument_imports():
    import hpack

    from appliance.adapters.grpc import calls, dispatch
    from appliance.adapters.grpc.h2 import frames, headers
    from appliance.adapters.grpc.h2.connection import Connection
    from appliance.adapters.grpc.h2.limits import H2Limits

SENT_BY_SERVER = {
    frames.DATA, frames.HEADERS, frames.RST_STREAM, frames.SETTINGS,
    frames.PING, frames.GOAWAY, frames.WINDOW_UPDATE,
}  # fmt: skip
PREFACE = frames.PREFACE + frames.frame(frames.SETTINGS, 0, 0)


class Bug(Exception):
    pass


class _Fails(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            raise Bug(record.getMessage())


class _Transport:
    """What a Connection needs of an asyncio transport; it keeps what is written."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closing = False

    def write(self, data: Any) -> None:
        self.out += data

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.out += chunk

    def close(self) -> None:
        self.closing = True

    abort = close

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


async def _echo(request: Any, context: Any) -> Any:
    return request


async def _stream(requests: Any, context: Any) -> Any:
    async for request in requests:
        yield request


METHODS = {
    "/t.S/Echo": calls.Method(calls.UNARY, _echo, bytes, bytes),
    "/t.S/Stream": calls.Method(calls.STREAM, _stream, bytes, bytes),
}
LIMITS = H2Limits(read_timeout_s=0.05, idle_timeout_s=0.05)


def _check_output(out: bytes) -> None:
    decoder = hpack.Decoder()
    i = 0
    while i + 9 <= len(out):
        length = int.from_bytes(out[i : i + 3], "big")
        kind = out[i + 3]
        if length > frames.MAX_FRAME:
            raise Bug(f"the server wrote a frame of {length} bytes")
        if kind not in SENT_BY_SERVER:
            raise Bug(f"the server wrote a frame of type {kind}")
        if kind == frames.HEADERS:
            decoder.decode(out[i + 9 : i + 9 + length])
        i += 9 + length


async def _session(data: bytes) -> None:
    conn = Connection(dispatch.Dispatcher(METHODS), 4096, lambda c: None, LIMITS)
    transport = _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    stream = data if data[:1] and data[0] & 1 else PREFACE + data[1:]
    step = 1 + (data[-1] if data else 0) % 97
    for i in range(0, len(stream), step):
        conn.data_received(stream[i : i + step])
        await asyncio.sleep(0)
    for _ in range(3):
        await asyncio.sleep(0)
    conn.close()
    for task in list(conn.calls):
        task.cancel()
    await asyncio.sleep(0)
    conn.connection_lost(None)
    _check_output(bytes(transport.out))


def fuzz_h2(data: bytes) -> None:
    asyncio.run(_session(data))


def fuzz_hpack(data: bytes) -> None:
    decoder = headers.HeaderDecoder(32768)
    try:
        decoder.decode(data)
        decoder.decode(data, trailers=True)
    except frames.ProtocolError as exc:
        if exc.code != frames.COMPRESSION_ERROR:
            raise


DEFAULT_BOUNDS = ("-max_total_time=300", "-runs=1000000")


def main() -> None:
    target = sys.argv.pop(1) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "h2"
    for bound in DEFAULT_BOUNDS:  # never unbounded: the ones not given on the command line
        if not any(arg.startswith(bound.split("=")[0] + "=") for arg in sys.argv[1:]):
            sys.argv.append(bound)
    logging.getLogger("appliance").addHandler(_Fails())
    logging.getLogger("asyncio").addHandler(_Fails())
    logging.getLogger("appliance").setLevel(logging.WARNING)
    atheris.Setup(sys.argv, {"h2": fuzz_h2, "hpack": fuzz_hpack}[target])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
