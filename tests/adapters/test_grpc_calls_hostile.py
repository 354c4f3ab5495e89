"""The gRPC endpoint's gRPC layer against hostile peers (grpc/grpc doc/PROTOCOL-HTTP2.md,
RFC 9113 8.2-8.3): raw frames on a real loopback socket (tests/h2_peer.py), each bad
request answered precisely (the grpc-status and HTTP status grpc-go answers with, or
RST_STREAM PROTOCOL_ERROR for a malformed request) on a connection that goes on
serving, while a well-behaved tritonclient.grpc client keeps being served.

Cases: message length prefixes over the limit (answered before the message is read),
compressed flags without or with an unknown encoding, gzip bombs and broken gzip,
unary calls with no or two messages, grpc-timeout values, malformed requests
(pseudo-headers, field names and values, connection-specific fields, te), method and
content-type, and GOAWAY: in-flight streams finish, new ones are refused.
The HTTP/2 layer's own cases are in test_grpc_h2_hostile.py.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from typing import Any

import pytest
from grpc_helpers import Bystander, infer_request, no_error_logged, serve
from h2_peer import (
    DATA,
    END_STREAM,
    GOAWAY,
    INFER,
    LIVE,
    NO_ERROR,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    STREAM_INFER,
    Peer,
    frame,
    grpc_message,
    request_headers,
)

__all__ = ["no_error_logged", "serve"]  # fixtures
pytestmark = pytest.mark.usefixtures("no_error_logged")


@pytest.fixture
def server(serve: Any) -> Any:
    return serve(max_request_size="1MiB")


def _answer(peer: Peer, sid: int) -> dict[str, str]:
    fields, _ = peer.answer(sid)
    return fields


def _outcome(fields: dict[str, str]) -> tuple[str, ...]:
    """(HTTP status, grpc-status) of an answer, or ("rst", code) of a reset."""
    if "rst" in fields:
        return ("rst", fields["rst"])
    return (fields.get(":status", ""), fields.get("grpc-status", ""))


def test_message_length_compression_and_message_count(server: Any) -> None:
    url = server.grpc_url
    bomb = gzip.compress(b"\x00" * (64 * 2**20))  # 64 MiB of zeros in ~64 KiB
    with Bystander(url), Peer(url) as p:
        # a length prefix over max_request_size: answered before the message is read
        prefix = grpc_message(b"x" * 10, length=2**32 - 1)
        p.send(p.headers(1, request_headers(INFER)), frame(DATA, 0, 1, prefix))
        fields = _answer(p, 1)
        assert _outcome(fields) == ("200", "8"), fields  # RESOURCE_EXHAUSTED
        assert "larger than max" in fields["grpc-message"]
        cases = {
            "compressed without grpc-encoding": ({}, grpc_message(b"", flag=1), "13"),
            "a compressed flag of 2": ({"grpc_encoding": "gzip"}, grpc_message(b"", 2), "13"),
            "a gzip bomb": ({"grpc_encoding": "gzip"}, grpc_message(bomb, 1), "8"),
            "a truncated gzip": ({"grpc_encoding": "gzip"}, grpc_message(bomb[:100], 1), "13"),
            "bytes after the gzip": (
                {"grpc_encoding": "gzip"},
                grpc_message(gzip.compress(b"") + b"junk", 1),
                "13",
            ),
            "corrupt deflate": ({"grpc_encoding": "deflate"}, grpc_message(b"\x00\x01", 1), "13"),
            "valid deflate": (
                {"grpc_encoding": "deflate"},
                grpc_message(zlib.compress(b""), 1),
                "0",
            ),
            "two messages on a unary call": ({}, grpc_message(b"") * 2, "13"),
            "no message on a unary call": ({}, b"", "13"),
        }
        wrong = {}
        sid = 1
        for name, (extra, body, status) in cases.items():
            sid += 2
            p.send(p.headers(sid, request_headers(LIVE, **extra)), p.data(sid, body))
            fields = _answer(p, sid)
            if fields.get("grpc-status") != status:
                wrong[name] = fields
        # an encoding the server cannot read: UNIMPLEMENTED, and the ones it can
        sid += 2
        p.send(p.call(sid, LIVE, grpc_encoding="snappy"))
        fields = _answer(p, sid)
        if fields.get("grpc-status") != "12" or "gzip" not in fields.get(
            "grpc-accept-encoding", ""
        ):
            wrong["snappy"] = fields
        assert not wrong, wrong


def test_grpc_timeout_values(server: Any) -> None:
    url = server.grpc_url
    cases = {
        "²S": ("400", "13"),  # not ASCII digits
        "123456789S": ("400", "13"),  # 9 digits
        "10x": ("400", "13"),
        "S": ("400", "13"),
        "-1S": ("400", "13"),
        "99999999H": ("200", "0"),  # the longest allowed: 11,415 years
        "100S": ("200", "0"),
    }
    with Bystander(url), Peer(url) as p:
        got = {}
        for i, value in enumerate(cases):
            sid = 2 * i + 1
            p.send(p.call(sid, LIVE, grpc_timeout=value))
            fields = _answer(p, sid)
            got[value] = _outcome(fields)
            if got[value][0] == "400":
                assert "malformed grpc-timeout" in fields["grpc-message"]
        assert got == cases


def test_malformed_requests_are_reset_and_bad_gets_are_refused(server: Any) -> None:
    url = server.grpc_url
    malformed = {
        "no :path": request_headers(**{":path": None}),
        "an empty :path": request_headers(**{":path": ""}),
        "no :method": request_headers(**{":method": None}),
        "no :scheme": request_headers(**{":scheme": None}),
        "a repeated :method": [*request_headers()[:1], *request_headers()],
        "an unknown pseudo-header": [(":foo", "x"), *request_headers()],
        "a response pseudo-header": [(":status", "200"), *request_headers()],
        "a pseudo-header after a field": [*request_headers(), (":protocol", "x")],
        "an upper-case name": [*request_headers(), ("X-Upper", "1")],
        "a name with a space": [*request_headers(), ("x y", "1")],
        "connection: keep-alive": [*request_headers(), ("connection", "keep-alive")],
        "transfer-encoding": [*request_headers(), ("transfer-encoding", "chunked")],
        "te: gzip": request_headers(te="gzip"),
        "a value with a leading space": [*request_headers(), ("x-v", " 1")],
        "a value with a NUL": [*request_headers(), ("x-v", "a\x00b")],
        "a value with CR LF": [*request_headers(), ("x-v", "a\r\nb")],
    }
    refused = {
        "GET": (request_headers(**{":method": "GET"}), ("405", "13")),
        "application/json": (request_headers(content_type="application/json"), ("415", "3")),
        "application/grpcfoo": (request_headers(content_type="application/grpcfoo"), ("415", "3")),
        "no content-type": (request_headers(content_type=None), ("415", "3")),
        "unknown method": (request_headers("/no.Such/Method"), ("200", "12")),
        "application/grpc+proto": (
            request_headers(content_type="application/grpc+proto"),
            ("200", "0"),
        ),
        "no te": (request_headers(te=None), ("200", "0")),
    }
    with Bystander(url), Peer(url) as p:
        wrong: dict[str, Any] = {}
        sid = -1
        for name, headers in malformed.items():
            sid += 2
            p.send(p.headers(sid, headers), frame(DATA, END_STREAM, sid, grpc_message(b"")))
            got = _outcome(_answer(p, sid))
            if got != ("rst", str(PROTOCOL_ERROR)):
                wrong[name] = got
        for name, (headers, expected) in refused.items():
            sid += 2
            p.send(p.headers(sid, headers), frame(DATA, END_STREAM, sid, grpc_message(b"")))
            got = _outcome(_answer(p, sid))
            if got != expected:
                wrong[name] = got
        assert not wrong, wrong
        p.send(p.call(sid + 2, LIVE))  # the connection still serves
        assert _outcome(_answer(p, sid + 2)) == ("200", "0")


def test_goaway_lets_streams_in_flight_finish_and_refuses_new_ones(server: Any) -> None:
    """Graceful shutdown: GOAWAY NO_ERROR naming the last stream taken; that stream goes
    on to its end (a streaming call here, held open by the client), a stream the client
    opens after it is refused (REFUSED_STREAM: it may retry elsewhere), and the
    connection closes once the last stream is done."""
    from appliance.adapters.grpc.server import GrpcEndpoint

    endpoint = GrpcEndpoint(server.server.dataplane, "127.0.0.1", 0, 2**20)
    port = server.call(endpoint.start())
    url = f"127.0.0.1:{port}"
    with Bystander(server.grpc_url), Peer(url) as p:
        p.send(p.headers(1, request_headers(STREAM_INFER)))
        p.send(frame(DATA, 0, 1, grpc_message(infer_request())))
        assert p.until(DATA, 1)  # the stream is under way
        stopping = threading.Thread(target=server.call, args=(endpoint.stop(60.0),))
        stopping.start()
        try:
            got = p.until(GOAWAY)
            assert (got.code, got.last_stream) == (NO_ERROR, 1)
            p.send(p.call(3, LIVE))
            refused = p.until(RST_STREAM, 3)
            assert refused.code == REFUSED_STREAM
            p.send(frame(DATA, 0, 1, grpc_message(infer_request())))  # still served
            assert p.until(DATA, 1)
            p.send(frame(DATA, END_STREAM, 1))
            fields, _ = p.answer(1)
            assert fields.get("grpc-status") == "0", fields
            assert list(p.frames()) == [] and p.eof  # closed once the stream is done
        finally:
            stopping.join(90)
    # the client's own GOAWAY: the server finishes the stream, then closes
    other = GrpcEndpoint(server.server.dataplane, "127.0.0.1", 0, 2**20)
    url = f"127.0.0.1:{server.call(other.start())}"
    with Peer(url) as p:
        p.send(p.headers(1, request_headers(STREAM_INFER)))
        p.send(frame(GOAWAY, 0, 0, b"\x00\x00\x00\x00\x00\x00\x00\x00"))
        p.send(frame(DATA, END_STREAM, 1, grpc_message(infer_request())))
        fields, data = p.answer(1)
        assert fields.get("grpc-status") == "0" and data, fields
        assert list(p.frames()) == [] and p.eof
    server.call(other.stop(5.0))
