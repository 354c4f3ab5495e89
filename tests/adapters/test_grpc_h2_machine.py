"""The gRPC endpoint's HTTP/2 state machine (appliance/adapters/grpc/h2/machine.py) on
its own, with no event loop, socket or clock: bytes in with a time, bytes out. What a
connection does is a function of what its client sent and when, so a case is a list
of byte strings and the frames the server queued in answer."""

from __future__ import annotations

import struct
from typing import Any

import hpack
from h2_peer import (
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    request_headers,
    settings,
)

from appliance.adapters.grpc.h2.frames import ENHANCE_YOUR_CALM, SETTINGS_TIMEOUT, Stream
from appliance.adapters.grpc.h2.limits import H2Limits
from appliance.adapters.grpc.h2.machine import ADMITTED, Machine


class _Call:
    """What a gRPC call is told by the machine, recorded."""

    unary = True

    def __init__(self, machine: Machine, stream: Stream, log: list[Any]) -> None:
        self.machine, self.stream, self.log = machine, stream, log

    def admit(self, size: int) -> int:
        self.log.append(("admit", self.stream.id, size))
        return ADMITTED

    def message(self, data: bytes, compressed: int) -> None:
        self.log.append(("message", self.stream.id, data))

    def end(self, leftover: bool) -> None:
        self.log.append(("end", self.stream.id, leftover))
        sid = self.stream.id
        head = frame(HEADERS, END_HEADERS, sid, b"")
        tail = frame(HEADERS, END_HEADERS | END_STREAM, sid, b"")
        self.machine.out.send(self.stream, head, b"answer", tail, True)

    def cancel(self) -> None:
        self.log.append(("cancel", self.stream.id))


class _Handler:
    def __init__(self) -> None:
        self.log: list[Any] = []
        self.machine: Machine | None = None

    def open(self, connection: Any, stream: Stream) -> None:
        assert self.machine is not None and connection == "driver"
        stream.call = _Call(self.machine, stream, self.log)
        self.log.append(("open", stream.id))


def _machine(**limits: Any) -> tuple[Machine, _Handler]:
    handler = _Handler()
    machine = Machine(handler, H2Limits(**limits), "driver")
    handler.machine = machine
    machine.start(0.0)
    return machine, handler


def _frames(chunks: list[bytes | memoryview]) -> list[tuple[int, int, int, bytes]]:
    data, out, i = b"".join(chunks), [], 0
    while i + 9 <= len(data):
        n = int.from_bytes(data[i : i + 3], "big")
        sid = int.from_bytes(data[i + 5 : i + 9], "big") & 0x7FFFFFFF
        out.append((data[i + 3], data[i + 4], sid, data[i + 9 : i + 9 + n]))
        i += 9 + n
    assert i == len(data)
    return out


def test_a_unary_call_in_and_its_answer_out_with_no_event_loop() -> None:
    machine, handler = _machine()
    opening = _frames(machine.out.take())
    assert opening[0][0] == SETTINGS
    block = hpack.Encoder().encode(request_headers("/p.S/M"))
    message = b"\0" + struct.pack(">I", 5) + b"hello"
    machine.receive(
        PREFACE
        + settings()
        + frame(SETTINGS, 1, 0)
        + frame(HEADERS, END_HEADERS, 1, block)
        + frame(PING, 0, 0, b"12345678")
        + frame(DATA, END_STREAM, 1, message[:7]),
        1.0,
    )
    # the message was admitted at its prefix, the stream ended inside it: the call says so
    assert handler.log == [("open", 1), ("admit", 1, 5), ("end", 1, True)]
    out = _frames(machine.out.take())
    assert [(k, fl, sid) for k, fl, sid, _ in out] == [
        (SETTINGS, 1, 0),  # the client's SETTINGS acknowledged
        (PING, 1, 0),
        (HEADERS, END_HEADERS, 1),  # the call's answer, in order
        (DATA, 0, 1),
        (HEADERS, END_HEADERS | END_STREAM, 1),
    ]
    assert out[1][3] == b"12345678" and out[3][3] == b"answer"
    assert not machine.streams and machine.closing is None


def test_messages_are_admitted_at_their_prefix_and_handed_over_whole() -> None:
    machine, handler = _machine()
    machine.out.take()
    block = hpack.Encoder().encode(request_headers("/p.S/M"))
    message = b"\0" + struct.pack(">I", 5) + b"hello"
    machine.receive(PREFACE + settings() + frame(SETTINGS, 1, 0), 0.0)
    assert [k for k, *_ in _frames(machine.out.take())] == [SETTINGS]  # the acknowledgement
    machine.receive(frame(HEADERS, END_HEADERS, 1, block) + frame(DATA, 0, 1, message[:7]), 0.1)
    assert handler.log == [("open", 1), ("admit", 1, 5)]  # admitted; nothing handed yet
    machine.receive(frame(DATA, END_STREAM, 1, message[7:]), 0.2)
    assert handler.log[2:] == [("message", 1, b"hello"), ("end", 1, False)]
    out = _frames(machine.out.take())
    assert [k for k, *_ in out] == [HEADERS, DATA, HEADERS]
    assert machine.out.take() == []
    assert not machine.streams


def test_the_watchdog_asks_for_the_settings_acknowledgement_in_time() -> None:
    machine, _ = _machine(read_timeout_s=2.0)
    machine.receive(PREFACE + settings(), 0.5)
    assert machine.overdue(1.0, False) == ("", 0)
    why, code = machine.overdue(2.5, False)
    assert code == SETTINGS_TIMEOUT and "acknowledged" in why
    machine.receive(frame(SETTINGS, 1, 0), 2.6)
    assert machine.overdue(2.7, False) == ("", 0)


def test_a_ping_flood_ends_the_connection_with_goaway() -> None:
    machine, _ = _machine()
    machine.receive(PREFACE + settings() + frame(SETTINGS, 1, 0), 0.0)
    machine.receive(b"".join(frame(PING, 0, 0, b"x" * 8) for _ in range(10_000)), 0.1)
    assert machine.closing is not None and machine.closing[0] == ENHANCE_YOUR_CALM
    out = _frames(machine.out.take())
    assert out[-1][0] == GOAWAY
    machine.receive(frame(PING, 0, 0, b"x" * 8), 0.2)  # after the end: nothing more
    assert machine.out.take() == []


def test_a_window_update_releases_data_waiting_for_window() -> None:
    machine, _ = _machine()
    block = hpack.Encoder().encode(request_headers("/p.S/M"))
    message = b"\0" + struct.pack(">I", 1) + b"x"
    machine.receive(PREFACE + settings(s4=4) + frame(SETTINGS, 1, 0), 0.0)
    machine.out.take()
    machine.receive(frame(HEADERS, END_HEADERS, 1, block) + frame(DATA, END_STREAM, 1, message), 0)
    out = _frames(machine.out.take())
    assert [(k, p) for k, _, _, p in out] == [(HEADERS, b""), (DATA, b"answ")]  # 4 bytes of window
    machine.receive(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 100)), 0.1)
    out = _frames(machine.out.take())
    assert [(k, p) for k, _, _, p in out] == [(DATA, b"er"), (HEADERS, b"")]  # then trailers
    assert not machine.streams
