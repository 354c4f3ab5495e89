"""The gRPC endpoint's HTTP/2 layer (``grpc_h2.Connection``) against the ``h2`` library
(hyper's HTTP/2 state machine, which hypercorn and others serve with) as the oracle.

Each case is the bytes a client sends: valid sequences and hostile ones (frame rules,
stream states, SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, header blocks, flow
control). The same bytes go to a real ``Connection`` (its writes captured, no socket:
the calls it opens are never run) and to an ``h2`` server connection, and both must
reach the same verdict: the same connection error code (GOAWAY), or none and the same
streams reset with the same codes. Where the two differ on purpose the case names
the reason and asserts this server's answer (RFC 9113 over h2's stricter reading).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import hpack
import pytest
from h2_peer import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    request_headers,
    settings,
)

from appliance.adapters.grpc import calls as grpc_calls
from appliance.adapters.grpc import dispatch
from appliance.adapters.grpc.h2.connection import Connection
from appliance.adapters.grpc.h2.limits import H2Limits

h2_connection = pytest.importorskip("h2.connection")
h2_config = pytest.importorskip("h2.config")
h2_exceptions = pytest.importorskip("h2.exceptions")

STREAM = "/t.S/Stream"
MAX_MESSAGE = 1 << 20


async def _sink(requests: Any, context: Any) -> Any:  # never run: no loop turn is given
    async for _ in requests:
        yield b""


METHODS = {STREAM: grpc_calls.Method(grpc_calls.STREAM, _sink, bytes, bytes)}


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closing = False

    def write(self, data: Any) -> None:
        self.out += data

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.out += chunk

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

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

    def set_write_buffer_limits(self, high: Any = None, low: Any = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def _verdict(out: bytes, skip_settings: bool) -> tuple[int | None, dict[int, int]]:
    """(GOAWAY's error code or None, {stream: RST_STREAM code}) of a server's bytes."""
    goaway, resets = None, {}
    i = 0
    while i + 9 <= len(out):
        n = int.from_bytes(out[i : i + 3], "big")
        kind, sid = out[i + 3], int.from_bytes(out[i + 5 : i + 9], "big") & 0x7FFFFFFF
        payload = out[i + 9 : i + 9 + n]
        if kind == GOAWAY:
            goaway = struct.unpack(">I", payload[4:8])[0]
        elif kind == RST_STREAM:
            resets[sid] = struct.unpack(">I", payload)[0]
        i += 9 + n
    return goaway, resets


def ours(data: bytes, max_message: int = MAX_MESSAGE) -> tuple[int | None, dict[int, int]]:
    """This server's verdict, its windows sized for ``max_message`` (as the endpoint
    sizes them from max_request_size)."""

    async def run() -> bytes:
        limits = H2Limits().for_message(max_message)
        conn = Connection(dispatch.Dispatcher(METHODS), max_message, lambda c: None, limits)
        transport = _Transport()
        conn.connection_made(transport)
        conn.data_received(data)
        conn.connection_lost(None)  # its streams dropped (no call is run), timers cancelled
        return bytes(transport.out)

    return _verdict(asyncio.run(run()), True)


def oracle(data: bytes, connection_back: bool = False) -> tuple[int | None, dict[int, int]]:
    """h2's verdict; ``connection_back``: the connection's window handed back for every
    DATA frame as it arrives (this server's rule), a stream's never (a streaming call
    that reads nothing)."""
    config = h2_config.H2Configuration(client_side=False, header_encoding=None)
    conn = h2_connection.H2Connection(config=config)
    conn.initiate_connection()
    conn.data_to_send()
    try:
        for chunk in _frames(data) if connection_back else [data]:
            for event in conn.receive_data(chunk):
                length = getattr(event, "flow_controlled_length", 0)
                if connection_back and length:
                    conn.increment_flow_control_window(length)
    except h2_exceptions.ProtocolError as exc:
        return int(exc.error_code), {}
    return _verdict(conn.data_to_send(), False)


def _frames(data: bytes) -> list[bytes]:
    """The preface, then each frame of ``data`` on its own."""
    out, i = [data[: len(PREFACE)]], len(PREFACE)
    while i < len(data):
        n = 9 + int.from_bytes(data[i : i + 3], "big")
        out.append(data[i : i + n])
        i += n
    return out


def _block(path: str = STREAM, **extra: str) -> bytes:
    return hpack.Encoder().encode(request_headers(path, **extra))


def _open(sid: int = 1, end: bool = False) -> bytes:
    return frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), sid, _block())


def _message(payload: bytes = b"abc") -> bytes:
    return struct.pack(">BI", 0, len(payload)) + payload


START = PREFACE + frame(SETTINGS, 0, 0)
W = struct.Struct(">I")

CASES: dict[str, bytes] = {
    "a call": START + _open() + frame(DATA, END_STREAM, 1, _message()),
    "a call in pieces": START
    + frame(HEADERS, 0, 1, _block()[:5])
    + frame(CONTINUATION, END_HEADERS, 1, _block()[5:])
    + frame(DATA, 0, 1, _message()[:3])
    + frame(DATA, END_STREAM, 1, _message()[3:]),
    "two calls": START + _open(1) + frame(DATA, END_STREAM, 1, _message()) + _open(3, True),
    "padded DATA": START
    + _open()
    + frame(DATA, PADDED | END_STREAM, 1, b"\x02" + _message() + b"\0\0"),
    "PING, SETTINGS, WINDOW_UPDATE": START
    + frame(PING, 0, 0, b"12345678")
    + settings(s4=1000, s5=20000)
    + frame(WINDOW_UPDATE, 0, 0, W.pack(1000)),
    "a client's RST_STREAM": START + _open() + frame(RST_STREAM, 0, 1, W.pack(8)),
    "PRIORITY on an idle stream": START + frame(PRIORITY, 0, 5, W.pack(0) + b"\x10"),
    "DATA on stream 0": START + frame(DATA, 0, 0, b"x"),
    "DATA on an idle stream": START + frame(DATA, 0, 1, b"x"),
    "HEADERS with an even id": START + frame(HEADERS, END_HEADERS, 2, _block()),
    "HEADERS on stream 0": START + frame(HEADERS, END_HEADERS, 0, _block()),
    "a stream id that goes down": START + _open(5) + _open(3),
    "a PING of 7 bytes": START + frame(PING, 0, 0, b"1234567"),
    "a PING on a stream": START + frame(PING, 0, 1, b"12345678"),
    "SETTINGS on a stream": START + frame(SETTINGS, 0, 1),
    "SETTINGS of 5 bytes": START + frame(SETTINGS, 0, 0, b"\0\0\0\0\0"),
    "a SETTINGS ACK with a payload": START + frame(SETTINGS, 1, 0, settings(s4=1)[9:]),
    "ENABLE_PUSH 2": START + settings(s2=2),
    "INITIAL_WINDOW_SIZE 2^31": START + settings(s4=2**31),
    "MAX_FRAME_SIZE 100": START + settings(s5=100),
    "a WINDOW_UPDATE of 0": START + frame(WINDOW_UPDATE, 0, 0, W.pack(0)),
    "a WINDOW_UPDATE of 3 bytes": START + frame(WINDOW_UPDATE, 0, 0, b"\0\0\1"),
    "the connection window past 2^31-1": START + frame(WINDOW_UPDATE, 0, 0, W.pack(2**31 - 1)),
    "a WINDOW_UPDATE on an idle stream": START + frame(WINDOW_UPDATE, 0, 9, W.pack(1)),
    "a stream window past 2^31-1": START + _open() + frame(WINDOW_UPDATE, 0, 1, W.pack(2**31 - 1)),
    "RST_STREAM on an idle stream": START + frame(RST_STREAM, 0, 1, W.pack(8)),
    "RST_STREAM on stream 0": START + frame(RST_STREAM, 0, 0, W.pack(8)),
    "RST_STREAM of 3 bytes": START + _open() + frame(RST_STREAM, 0, 1, b"\0\0\0"),
    "CONTINUATION without HEADERS": START + frame(CONTINUATION, END_HEADERS, 1, _block()),
    "a header block interrupted": START
    + frame(HEADERS, 0, 1, _block()[:5])
    + frame(PING, 0, 0, b"12345678"),
    "a frame over 16384 bytes": START + _open() + frame(DATA, 0, 1, bytes(16385)),
    "padding past the frame": START + _open() + frame(DATA, PADDED, 1, b"\x09" + bytes(4)),
    "DATA after END_STREAM": START + _open(1, True) + frame(DATA, 0, 1, b"x"),
    "a push promise": START + frame(5, END_HEADERS, 1, W.pack(2) + _block()),
    "a preface without SETTINGS": PREFACE + frame(PING, 0, 0, b"12345678"),
}
# flow control, with windows of 65,535 bytes (max_request_size 65,530): the connection's
# is handed back as DATA arrives, a streaming call's only as it reads its messages
SMALL = 65530
_PIECE = _message(bytes(16000))
FLOW: dict[str, bytes] = {
    "messages within the stream's window": START
    + _open()
    + b"".join(frame(DATA, 0, 1, _PIECE) for _ in range(4)),
    "unread messages past the stream's window": START
    + _open()
    + b"".join(frame(DATA, 0, 1, _PIECE) for _ in range(5)),
    "unread messages on two streams": START
    + _open(1)
    + _open(3)
    + b"".join(frame(DATA, 0, sid, _PIECE) for _ in range(3) for sid in (1, 3)),
}
# where this server and h2 differ on purpose: the case, and this server's verdict
DEVIATIONS: dict[str, tuple[int | None, dict[int, int]]] = {
    # RFC 9113 6.9: a stream's WINDOW_UPDATE of 0 is a stream error (h2 ends the
    # connection)
    "a stream WINDOW_UPDATE of 0": (None, {1: 1}),
    # RFC 9113 6.5: a SETTINGS ACK with a payload is FRAME_SIZE_ERROR (h2: PROTOCOL_ERROR)
    "a SETTINGS ACK with a payload": (6, {}),
    # RFC 9113 3.4: the preface must be followed by SETTINGS, else PROTOCOL_ERROR (h2
    # takes any frame)
    "a preface without SETTINGS": (1, {}),
}
CASES["a stream WINDOW_UPDATE of 0"] = START + _open() + frame(WINDOW_UPDATE, 0, 1, W.pack(0))


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_server_answers_as_h2_does(name: str) -> None:
    data = CASES[name]
    got = ours(data)
    if name in DEVIATIONS:
        assert got == DEVIATIONS[name], got
        assert oracle(data) != got  # (a deviation h2 no longer has is dropped from the list)
        return
    assert got == oracle(data), (got, oracle(data))


# RFC 9113 6.9.1 lets a receiver answer a sender past a window with a stream or a
# connection error: this server resets that stream only (the others go on), h2 ends
# the connection
FLOW_DEVIATIONS = {"unread messages past the stream's window": (None, {1: 3})}


@pytest.mark.parametrize("name", sorted(FLOW))
def test_flow_control_is_as_h2_counts_it(name: str) -> None:
    data = FLOW[name]
    got, expected = ours(data, SMALL), oracle(data, connection_back=True)
    if name in FLOW_DEVIATIONS:
        assert got == FLOW_DEVIATIONS[name] and expected == (3, {}), (got, expected)
        return
    assert got == expected
