"""The gRPC endpoint's HTTP/2 framing against hostile peers (RFC 9113, RFC 7541): raw
frames on a real loopback socket (tests/h2_peer.py), each attack answered with the
protocol's own reaction (which frame, which error code), while a well-behaved
tritonclient.grpc client on its own connection keeps being served during and after.

Attack classes: concurrent-stream limits, Rapid Reset (CVE-2023-44487), header list
limits and HPACK errors (decode bombs, table size, Huffman, integers), CONTINUATION
floods (CVE-2024-27316 class), PING / SETTINGS / empty-frame / PRIORITY / unknown-type
floods (CVE-2019-9512..9518 class), SETTINGS / PING / WINDOW_UPDATE rules and window
overflows, frames on idle and closed streams, stream id rules, frame size, padding and
PRIORITY self-dependency. Slow, silent and non-reading peers, flow control and the
connection limit are in test_grpc_h2_peers.py; the gRPC layer in
test_grpc_calls_hostile.py. No test may log an error: a traceback in the server fails it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any

import hpack
import pytest
from grpc_helpers import (
    Bystander,
    connection_error,
    infer_request,
    live,
    no_error_logged,
    serve,
    status,
)
from h2_peer import (
    CANCEL,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    HEADERS,
    INFER,
    INITIAL_WINDOW_SIZE,
    LIVE,
    MAX_CONCURRENT_STREAMS,
    MAX_HEADER_LIST_SIZE,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    Peer,
    frame,
    grpc_message,
    request_headers,
    rst,
    settings,
    window_update,
)

from appliance.adapters.grpc.messages import hpack_int

__all__ = ["no_error_logged", "serve"]  # fixtures
pytestmark = pytest.mark.usefixtures("no_error_logged")


def test_settings_are_advertised_and_concurrent_streams_enforced(serve: Any) -> None:
    server = serve(grpc_max_concurrent_streams=3, grpc_max_header_list_size="4KiB")
    with Bystander(server.grpc_url), Peer(server.grpc_url) as p:
        assert p.server_settings[MAX_CONCURRENT_STREAMS] == 3
        assert p.server_settings[MAX_HEADER_LIST_SIZE] == 4096
        assert p.server_settings[INITIAL_WINDOW_SIZE] == 16 * 2**20
        for sid in (1, 3, 5):  # three calls that wait for their request message
            p.send(p.headers(sid, request_headers(INFER)))
        p.send(p.headers(7, request_headers(INFER)))
        refused = p.until(RST_STREAM)
        assert (refused.sid, refused.code) == (7, REFUSED_STREAM)
        p.send(rst(1))  # the client gives one up: room for one more
        assert live(p, 9) == "0"


def test_rapid_reset_ends_with_enhance_your_calm(serve: Any) -> None:
    """CVE-2023-44487: streams opened and reset at once. A reset stream's call counts
    against the concurrent streams until it has unwound, and resets (and the refusals
    they lead to) spend the connection's budget: GOAWAY ENHANCE_YOUR_CALM, however fast
    the client goes."""
    server = serve()
    with Bystander(server.grpc_url), Peer(server.grpc_url) as p:
        body = grpc_message(infer_request("slow"))

        def attack() -> Iterator[bytes]:
            for i in range(5000):
                sid = 2 * i + 1
                yield p.headers(sid, request_headers(INFER))
                yield frame(DATA, END_STREAM, sid, body) + rst(sid, CANCEL)

        p.send_many(attack())
        got = p.goaway()
        assert got.code == ENHANCE_YOUR_CALM, got


def test_header_list_limits_and_hpack_errors(serve: Any) -> None:
    server = serve(grpc_max_header_list_size="4KiB")
    url = server.grpc_url
    with Bystander(url):
        with Peer(url) as p:  # over the advertised size: this call only
            p.send(p.call(1, LIVE, x_big="a" * 5000))
            fields, _ = p.answer(1)
            assert fields["grpc-status"] == "8", fields  # RESOURCE_EXHAUSTED
            assert "over the limit of 4096" in fields["grpc-message"]
            assert live(p, 3) == "0"
            # field bytes that are not UTF-8 are a value like any other
            p.send(p.headers(5, [*request_headers(), ("x-odd", b"\xff\xfe")]))  # type: ignore[list-item]
            p.send(frame(DATA, END_STREAM, 5, grpc_message(b"")))
            assert status(p.answer(5)[0]) == "0"
        # blocks for a fresh connection (both HPACK tables empty)
        pseudo = hpack.Encoder().encode(request_headers())
        bomb = hpack.Encoder().encode(request_headers() + [("x-b", "b" * 3000)] * 20)
        cases = {
            "decode bomb: one 3 KB table entry referenced 20 times": bomb,
            "a dynamic table size update over 4096": hpack_int(8192, 5, 0x20) + pseudo,
            "a Huffman string holding EOS": pseudo + b"\x00\x81a" + b"\x84\xff\xff\xff\xff",
            "an index past the tables": pseudo + b"\xff\x7f",
            "an integer of 20 bytes": pseudo + b"\x7f" + b"\xff" * 20 + b"\x00",
            "a truncated literal": pseudo + b"\x00\x05ab",
        }
        wrong = {}
        for name, block in cases.items():
            code, debug = connection_error(url, frame(HEADERS, END_HEADERS | END_STREAM, 1, block))
            if code != COMPRESSION_ERROR:
                wrong[name] = (code, debug)
        assert not wrong, wrong


def test_continuation_floods_and_header_block_rules(serve: Any) -> None:
    """CVE-2024-27316 class: a header block that never ends, in frames that add nothing
    or that add without end."""
    server = serve()
    url = server.grpc_url
    with Bystander(url):
        with Peer(url) as p:
            first = frame(HEADERS, 0, 1, p.block(request_headers())[:3])
            p.send_many([first] + [frame(CONTINUATION, 0, 1)] * 20000)
            got = p.goaway()
            assert got.code == ENHANCE_YOUR_CALM and b"frames" in got.debug, got
        with Peer(url) as p:
            chunks = [frame(CONTINUATION, 0, 1, b"\x00" * 8000)] * 10
            p.send_many([frame(HEADERS, 0, 1, p.block(request_headers())), *chunks])
            got = p.goaway()
            assert got.code == ENHANCE_YOUR_CALM and b"bytes" in got.debug, got
        interrupted = frame(HEADERS, 0, 1, b"\x82") + frame(PING, 0, 0, b"\x00" * 8)
        assert connection_error(url, interrupted)[0] == PROTOCOL_ERROR
        assert (
            connection_error(url, frame(CONTINUATION, END_HEADERS, 1, b"\x82"))[0] == PROTOCOL_ERROR
        )
        with Peer(url) as p:  # a block split over four frames is one request
            block = p.block(request_headers())
            step = (len(block) + 3) // 4
            parts = [block[i : i + step] for i in range(0, len(block), step)]
            p.send(frame(HEADERS, 0, 1, parts[0]))
            for part in parts[1:-1]:
                p.send(frame(CONTINUATION, 0, 1, part))
            p.send(frame(CONTINUATION, END_HEADERS, 1, parts[-1]))
            p.send(frame(DATA, END_STREAM, 1, grpc_message(b"")))
            assert status(p.answer(1)[0]) == "0"


@pytest.mark.parametrize(
    "what, flood",
    [
        ("PING", frame(PING, 0, 0, b"12345678")),
        ("SETTINGS", frame(SETTINGS, 0, 0)),
        ("PRIORITY", frame(PRIORITY, 0, 3, struct.pack(">IB", 1, 16))),
        ("unknown", frame(0x20, 0, 0, b"x")),
        ("empty DATA", frame(DATA, 0, 1)),
    ],
)
def test_floods_of_frames_that_serve_no_call(serve: Any, what: str, flood: bytes) -> None:
    """CVE-2019-9512 (ping), 9515 (settings), 9518 (empty frames) and their kin: each
    such frame spends the connection's budget; GOAWAY ENHANCE_YOUR_CALM when it is dry."""
    server = serve()
    with Bystander(server.grpc_url), Peer(server.grpc_url) as p:
        p.send(p.headers(1, request_headers(INFER)))  # the empty DATA frames' stream
        p.send_many([flood] * 20000)
        got = p.goaway()
        assert got.code == ENHANCE_YOUR_CALM, got
    with Peer(server.grpc_url) as p:  # a few are fine: every PING is answered
        p.send(*[frame(PING, 0, 0, b"%08d" % i) for i in range(200)])
        acks = [p.until(PING).payload for _ in range(200)]
        assert acks == [b"%08d" % i for i in range(200)]
        assert live(p, 1) == "0"


def test_settings_ping_and_window_update_rules(serve: Any) -> None:
    server = serve()
    url = server.grpc_url
    cases = {
        "SETTINGS on a stream": (frame(SETTINGS, 0, 1), PROTOCOL_ERROR),
        "SETTINGS of 5 bytes": (frame(SETTINGS, 0, 0, b"\x00" * 5), FRAME_SIZE_ERROR),
        "SETTINGS ACK with a payload": (frame(SETTINGS, 1, 0, b"\x00" * 6), FRAME_SIZE_ERROR),
        "SETTINGS of 100 entries": (
            frame(SETTINGS, 0, 0, struct.pack(">HI", 9, 1) * 100),
            ENHANCE_YOUR_CALM,
        ),
        "ENABLE_PUSH 2": (settings(s2=2), PROTOCOL_ERROR),
        "INITIAL_WINDOW_SIZE 2^31": (settings(s4=2**31), FLOW_CONTROL_ERROR),
        "MAX_FRAME_SIZE 100": (settings(s5=100), PROTOCOL_ERROR),
        "PING of 7 bytes": (frame(PING, 0, 0, b"1234567"), FRAME_SIZE_ERROR),
        "PING on a stream": (frame(PING, 0, 1, b"12345678"), PROTOCOL_ERROR),
        "WINDOW_UPDATE of 0": (window_update(0, 0), PROTOCOL_ERROR),
        "WINDOW_UPDATE of 3 bytes": (frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"), FRAME_SIZE_ERROR),
        "connection window past 2^31-1": (window_update(0, 2**31 - 1), FLOW_CONTROL_ERROR),
        "WINDOW_UPDATE on an idle stream": (window_update(9, 1), PROTOCOL_ERROR),
        "PUSH_PROMISE": (
            frame(PUSH_PROMISE, END_HEADERS, 1, b"\x00\x00\x00\x02\x82"),
            PROTOCOL_ERROR,
        ),
    }
    with Bystander(url):
        wrong = {}
        for name, (frames, code) in cases.items():
            got = connection_error(url, frames)
            if got[0] != code:
                wrong[name] = got
        # not SETTINGS right after the preface
        got = connection_error(url, PREFACE + frame(PING, 0, 0, b"12345678"), handshake=False)
        if got[0] != PROTOCOL_ERROR:
            wrong["PING before SETTINGS"] = got
        assert not wrong, wrong
        with Peer(url) as p:  # stream-level rules end the stream, not the connection
            p.send(p.headers(1, request_headers(INFER)), window_update(1, 0))
            got = p.until(RST_STREAM)
            assert (got.sid, got.code) == (1, PROTOCOL_ERROR)
            p.send(p.headers(3, request_headers(INFER)), window_update(3, 2**31 - 1))
            got = p.until(RST_STREAM)
            assert (got.sid, got.code) == (3, FLOW_CONTROL_ERROR)
            assert live(p, 5) == "0"


def test_frames_on_idle_and_closed_streams_and_stream_ids(serve: Any) -> None:
    server = serve()
    url = server.grpc_url
    even = request_headers()
    connection_errors: dict[str, tuple[Callable[[Peer], bytes], int]] = {
        "DATA on stream 0": (lambda q: frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
        "DATA on an idle stream": (lambda q: frame(DATA, 0, 9, b"x"), PROTOCOL_ERROR),
        "HEADERS with an even id": (lambda q: q.headers(2, even), PROTOCOL_ERROR),
        "HEADERS on stream 0": (lambda q: frame(HEADERS, END_HEADERS, 0, b"\x82"), PROTOCOL_ERROR),
        "RST_STREAM on an idle stream": (lambda q: rst(7), PROTOCOL_ERROR),
        "RST_STREAM on stream 0": (lambda q: rst(0), PROTOCOL_ERROR),
        "RST_STREAM of 3 bytes": (
            lambda q: frame(RST_STREAM, 0, 1, b"\x00\x00\x08"),
            FRAME_SIZE_ERROR,
        ),
        "a frame over 16384 bytes": (lambda q: frame(DATA, 0, 1, b"x" * 16385), FRAME_SIZE_ERROR),
        "DATA padding longer than the frame": (
            lambda q: q.headers(1, request_headers(INFER)) + frame(DATA, PADDED, 1, b"\x0a1234"),
            PROTOCOL_ERROR,
        ),
        "a padded DATA without its pad length": (
            lambda q: q.headers(1, request_headers(INFER)) + frame(DATA, PADDED, 1),
            FRAME_SIZE_ERROR,
        ),
        "HEADERS padding longer than the frame": (
            lambda q: frame(HEADERS, PADDED | END_HEADERS, 1, b"\x05\x82"),
            PROTOCOL_ERROR,
        ),
        "HEADERS too short for its priority": (
            lambda q: frame(HEADERS, PRIORITY_FLAG | END_HEADERS, 1, b"\x00\x00"),
            FRAME_SIZE_ERROR,
        ),
        "PRIORITY on stream 0": (
            lambda q: frame(PRIORITY, 0, 0, b"\x00\x00\x00\x01\x10"),
            PROTOCOL_ERROR,
        ),
    }
    with Bystander(url):
        wrong = {}
        for name, (make, code) in connection_errors.items():
            with Peer(url) as q:
                q.send(make(q))
                got = q.goaway()
            if got.code != code:
                wrong[name] = (got.code, got.debug)
        for name, second in {
            "a decreasing stream id": 3,
            "a stream id used again": 5,
        }.items():
            with Peer(url) as q:
                q.send(q.call(5, LIVE))
                assert status(q.answer(5)[0]) == "0"
                q.send(q.call(second, LIVE))
                got = q.goaway()
            if got.code != PROTOCOL_ERROR:
                wrong[name] = (got.code, got.debug)
        assert not wrong, wrong
        with Peer(url) as p:  # stream errors: RST_STREAM, the connection goes on
            looped = struct.pack(">IB", 1, 16) + p.block(request_headers())
            p.send(frame(HEADERS, PRIORITY_FLAG | END_HEADERS | END_STREAM, 1, looped))
            assert (p.until(RST_STREAM, 1).code) == PROTOCOL_ERROR
            p.send(frame(PRIORITY, 0, 11, struct.pack(">IB", 11, 16)))
            assert p.until(RST_STREAM, 11).code == PROTOCOL_ERROR
            p.send(frame(PRIORITY, 0, 13, b"\x00\x00\x00\x01"))
            assert p.until(RST_STREAM, 13).code == FRAME_SIZE_ERROR
            # DATA after the client ended the stream (a call still running)
            p.send(p.call(15, INFER, infer_request("slow")), frame(DATA, 0, 15, b"late"))
            assert p.until(RST_STREAM, 15).code == STREAM_CLOSED
            # trailers without END_STREAM, and trailers with a pseudo-header
            p.send(p.headers(17, request_headers(INFER)), p.headers(17, [("x-t", "1")]))
            assert p.until(RST_STREAM, 17).code == PROTOCOL_ERROR
            p.send(p.headers(19, request_headers(INFER)))
            p.send(p.headers(19, [(":path", "/x")], end_stream=True))
            assert p.until(RST_STREAM, 19).code == PROTOCOL_ERROR
            # DATA on a stream that is over: ignored
            assert live(p, 21) == "0"
            p.send(frame(DATA, 0, 21, b"late"), frame(PRIORITY, 0, 21, struct.pack(">IB", 0, 1)))
            assert live(p, 23) == "0"
