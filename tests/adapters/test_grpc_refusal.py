"""A hostile gRPC client against a server with an ``inference_token``: refused from
its HEADERS or its message's length prefix, before the server keeps its DATA.

Raw HTTP/2 frames (tests/h2_peer.py, header blocks by ``hpack``), as the flood of
docs/security.md ("What an unauthenticated peer can make the server hold"): ModelInfer
streams that declare 40 MiB messages and send their DATA anyway, with no token, with
a wrong token, and with the right token past the queued-bytes limit. Each test
asserts what the server answered (a trailers-only status, then RST_STREAM), that the
data sent after the refusal was dropped (nothing held in the queued bytes, no stream
kept), and that other calls are still served. The server's RSS (the test process,
which runs it) is printed, never asserted.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
from grpc_helpers import Bystander, infer_request, live, no_error_logged, serve, status
from h2_peer import (
    DATA,
    HEADERS,
    INFER,
    NO_ERROR,
    RST_STREAM,
    STREAM_INFER,
    Peer,
    frame,
    request_headers,
    rst,
)
from tritonclient.grpc import service_pb2

__all__ = ["no_error_logged", "serve"]  # fixtures
pytestmark = pytest.mark.usefixtures("no_error_logged")

TOKEN = "s3cret-token"
UNAUTHENTICATED, UNAVAILABLE, RESOURCE_EXHAUSTED = "16", "14", "8"
DECLARED = 40 * 2**20  # what each hostile message claims to weigh
SAFETY_S = 30.0  # a bound on waiting for the server, never a pass/fail on time


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _chunks(sid: int, total: int) -> Iterator[bytes]:
    """``total`` bytes of a message body as DATA frames of 16 KiB (no END_STREAM)."""
    piece = bytes(16384)
    for _ in range(total // len(piece)):
        yield frame(DATA, 0, sid, piece)


def _refusal(peer: Peer, sid: int) -> tuple[dict[str, str], int]:
    """The server's answer on ``sid``: its trailers-only header fields, and the code of
    the RST_STREAM that followed them (-1 when none came)."""
    fields: dict[str, str] = {}
    for got in peer.frames():
        if got.sid != sid:
            continue
        if got.kind == HEADERS:
            fields.update(got.headers)
        if got.kind == DATA:
            raise AssertionError(f"stream {sid} was answered with DATA: {got}")
        if got.kind == RST_STREAM:
            return fields, got.code
    return fields, -1


def _held(server: Any) -> int:
    return int(server.server.dataplane.queued.held)


def _settled(server: Any) -> None:
    """Wait (bounded) until nothing is held in the queued bytes and no stream is kept
    (the server may still be finishing the answer the client just read)."""
    deadline = time.monotonic() + SAFETY_S
    while (_held(server) or _streams_kept(server)) and time.monotonic() < deadline:
        time.sleep(0.02)


def _streams_kept(server: Any) -> int:
    connections = server.server._grpc.connections
    return sum(len(c.streams) + sum(len(s.buffer) for s in c.streams.values()) for c in connections)


@pytest.mark.parametrize("token", [None, "Bearer wrong"], ids=["no token", "wrong token"])
def test_a_call_without_the_token_is_refused_from_its_headers(
    serve: Any, token: str | None
) -> None:
    """Ten ModelInfer streams on one connection, each declaring a 40 MiB message and
    sending it: each is answered UNAUTHENTICATED (trailers-only) and reset at its
    HEADERS; the 400 MiB that follow are dropped as they come; a ServerLive on the
    same connection and a client with the token are served meanwhile."""
    server = serve(inference_token=TOKEN)
    idle = _rss_mib()
    with Peer(server.grpc_url) as p:
        with Bystander(server.grpc_url, token=TOKEN):
            for sid in range(1, 21, 2):
                headers = request_headers(INFER, authorization=token)
                p.send(p.headers(sid, headers))
                fields, code = _refusal(p, sid)
                assert status(fields) == UNAUTHENTICATED, fields
                assert "token" in fields.get("grpc-message", ""), fields
                assert code == NO_ERROR, code  # reset: the client must stop sending
                # the message the client sends anyway is dropped as it arrives
                assert p.send(frame(DATA, 0, sid, struct.pack(">BI", 0, DECLARED)))
                assert p.send_many(_chunks(sid, DECLARED))
            peak = _rss_mib()
            assert live(p, 41) == "0"  # the connection still serves
        _settled(server)  # (the bystander's calls hold their bytes while they run)
        assert _held(server) == 0 and _streams_kept(server) == 0
    time.sleep(1.5)  # the heap is trimmed after a quiet spell (printed, not asserted)
    print(f"\nRSS: idle {idle:.0f} MiB, after the flood {peak:.0f}, then {_rss_mib():.0f}")


def test_a_stream_without_the_token_is_refused_from_its_headers(serve: Any) -> None:
    """ModelStreamInfer without a token: UNAUTHENTICATED before its first message."""
    server = serve(inference_token=TOKEN)
    with Peer(server.grpc_url) as p:
        p.send(p.headers(1, request_headers(STREAM_INFER)))
        fields, code = _refusal(p, 1)
        assert status(fields) == UNAUTHENTICATED and code == NO_ERROR, (fields, code)
        p.send_many(_chunks(1, 4 * 2**20))
        assert live(p, 3) == "0"
        _settled(server)
        assert _held(server) == 0 and _streams_kept(server) == 0


def test_a_message_past_the_queued_bytes_limit_is_refused_from_its_prefix(serve: Any) -> None:
    """With the right token, past ``max_queued_bytes``: a 40 MiB message still arriving
    holds its bytes from its prefix on (a lone request is admitted whatever its size);
    a second one is answered UNAVAILABLE from its prefix, before any of it is kept.
    Once the first stream is reset its hold is given back, and calls are served."""
    server = serve(inference_token=TOKEN, max_queued_bytes="1MiB", max_request_size="64MiB")
    auth = f"Bearer {TOKEN}"
    with Peer(server.grpc_url) as p:
        p.send(p.headers(1, request_headers(INFER, authorization=auth)))
        p.send(frame(DATA, 0, 1, struct.pack(">BI", 0, DECLARED) + bytes(16379)))
        p.send_many(_chunks(1, 2**20))  # part of it: the rest never comes
        deadline = time.monotonic() + SAFETY_S
        while _held(server) < DECLARED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _held(server) == DECLARED  # held from the prefix on, for the whole message
        for sid in (3, 5, 7):
            p.send(p.headers(sid, request_headers(INFER, authorization=auth)))
            p.send(frame(DATA, 0, sid, struct.pack(">BI", 0, DECLARED)))
            fields, code = _refusal(p, sid)
            assert status(fields) == UNAVAILABLE, fields
            assert "max_queued_bytes" in fields.get("grpc-message", ""), fields
            assert code == NO_ERROR
            p.send_many(_chunks(sid, 4 * 2**20))  # dropped
        # a small call is refused too while the server is full (UNAVAILABLE, not a stall)
        p.send(p.call(9, INFER, infer_request(), authorization=auth))
        assert status(p.answer(9)[0]) == UNAVAILABLE
        assert _held(server) == DECLARED
        p.send(rst(1))  # the client gives up its message: the hold goes with it
        _settled(server)
        assert _held(server) == 0 and _streams_kept(server) == 0
        p.send(p.call(11, INFER, infer_request(), authorization=auth))
        assert status(p.answer(11)[0]) == "0"


def test_a_connection_that_dies_mid_message_gives_its_holds_back(serve: Any) -> None:
    """A client with the token sends part of two messages and drops the connection:
    their holds and buffers are given back (the queued bytes return to zero)."""
    server = serve(inference_token=TOKEN)
    auth = f"Bearer {TOKEN}"
    p = Peer(server.grpc_url)
    for sid in (1, 3):
        p.send(p.headers(sid, request_headers(INFER, authorization=auth)))
        p.send(frame(DATA, 0, sid, struct.pack(">BI", 0, DECLARED)))
        p.send_many(_chunks(sid, 2**20))
    assert live(p, 5) == "0"  # every frame before it was read
    assert _held(server) == 2 * DECLARED
    p.close()
    _settled(server)
    assert _held(server) == 0
    with Bystander(server.grpc_url, token=TOKEN):
        pass


def test_a_public_call_takes_small_messages_only(serve: Any) -> None:
    """What anyone may call without a token (ServerLive, health) takes a request of at
    most 4 KiB: a bigger length prefix is RESOURCE_EXHAUSTED before the message is kept."""
    server = serve(inference_token=TOKEN)
    with Peer(server.grpc_url) as p:
        p.send(p.headers(1, request_headers()))  # ServerLive, no token
        p.send(frame(DATA, 0, 1, struct.pack(">BI", 0, 4097)))
        fields, code = _refusal(p, 1)
        assert status(fields) == RESOURCE_EXHAUSTED and code == NO_ERROR, (fields, code)
        p.send_many(_chunks(1, 2**20))  # dropped
        assert live(p, 3) == "0"
        _settled(server)
        assert _held(server) == 0 and _streams_kept(server) == 0


def _stream_answers(p: Peer, sid: int, count: int) -> list[Any]:
    """The next ``count`` ModelStreamInferResponse messages on stream ``sid``."""
    data, answers = b"", []
    while len(answers) < count:
        got = p.next()
        assert got is not None, "the connection ended"
        assert not (got.sid == sid and got.kind == RST_STREAM), got
        assert not (got.sid == sid and got.kind == HEADERS and "grpc-status" in got.headers), got
        if got.sid != sid or got.kind != DATA:
            continue
        data += got.payload
        while len(data) >= 5 and len(data) >= 5 + int.from_bytes(data[1:5], "big"):
            n = int.from_bytes(data[1:5], "big")
            answers.append(service_pb2.ModelStreamInferResponse.FromString(data[5 : 5 + n]))
            data = data[5 + n :]
    return answers


def test_a_streamed_request_past_the_limit_is_refused_in_its_stream(serve: Any) -> None:
    """ModelStreamInfer, past ``max_queued_bytes``: the request whose message does not
    fit is answered in the stream with the refusal (Triton's error_message), its bytes
    dropped as they come, and the stream goes on: the next request is served."""
    server = serve(inference_token=TOKEN, max_queued_bytes="1MiB")
    auth = f"Bearer {TOKEN}"
    with Peer(server.grpc_url) as p:
        p.send(p.headers(1, request_headers(INFER, authorization=auth)))
        p.send(frame(DATA, 0, 1, struct.pack(">BI", 0, DECLARED)))  # held, never sent
        p.send(p.headers(3, request_headers(STREAM_INFER, authorization=auth)))
        p.send(frame(DATA, 0, 3, struct.pack(">BI", 0, 2 * 2**20)))
        assert p.send_many(_chunks(3, 2 * 2**20))  # the refused message, all of it
        (refused,) = _stream_answers(p, 3, 1)
        assert "max_queued_bytes" in refused.error_message, refused
        assert _held(server) == DECLARED  # nothing of the refused message held
        p.send(rst(1))
        deadline = time.monotonic() + SAFETY_S  # (the reset reaches the server)
        while _held(server) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _held(server) == 0
        p.send(frame(DATA, 0, 3, struct.pack(">BI", 0, len(infer_request())) + infer_request()))
        (served,) = _stream_answers(p, 3, 1)
        assert not served.error_message, served
        assert served.infer_response.model_name == "identity"
        p.send(frame(DATA, 1, 3, b""))  # END_STREAM: the call ends OK
        fields: dict[str, str] = {}
        while "grpc-status" not in fields:
            got = p.next()
            assert got is not None
            if got.sid == 3 and got.kind == HEADERS:
                fields.update(got.headers)
        assert fields["grpc-status"] == "0"
    _settled(server)
    assert _held(server) == 0
