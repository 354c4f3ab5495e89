"""The HTTP front (appliance.adapters.http.front): inference served on the connection
itself, every other request handed with its connection to aiohttp, with the same
answers either way, on asyncio's loop and on uvloop (what ``appliance serve`` runs).

Which side answered is visible from outside: aiohttp sends a ``Server`` header, the
front does not. No test depends on timing: dribbled and pipelined bytes may reach
the server in any grouping, and every grouping must give the same answers.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from http_helpers import Responses, simple_body

from appliance.adapters.http import head as http_head

SAFETY_S = 30.0  # a bound on waiting for the server, never a pass/fail on time


def _loops() -> list[Any]:
    loops: list[Any] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:  # the uvloop extra is not installed: its case skips
        loops.append(pytest.param(None, id="uvloop", marks=pytest.mark.skip("no uvloop")))
    else:
        loops.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    return loops


@pytest.fixture(params=_loops())
def new_loop(request: pytest.FixtureRequest) -> Callable[[], asyncio.AbstractEventLoop]:
    factory: Callable[[], asyncio.AbstractEventLoop] = request.param
    return factory


def _connect(srv: Any) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=SAFETY_S)


def _infer(body: bytes, model: str = "simple", extra: bytes = b"") -> bytes:
    return (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: t\r\n".encode()
        + extra
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def _simple(value: int) -> bytes:
    inputs = [
        {"name": n, "datatype": "INT32", "shape": [1, 16], "data": [value] * 16}
        for n in ("INPUT0", "INPUT1")
    ]
    return json.dumps({"inputs": inputs}).encode()


def _sum(body: bytes) -> list[int]:
    data: list[int] = json.loads(body)["outputs"][0]["data"]
    return data


# readiness asked with a query string: a request target the front leaves to aiohttp
GET_READY = b"GET /v2/health/ready?from=test HTTP/1.1\r\nHost: t\r\n\r\n"
# the read-only routes the front answers itself (model "nope" is not in the repository;
# "a..b" is not a model name; the demo's simple has no version 9)
READS = [
    "/v2",
    "/v2/",
    "/v2/health/live",
    "/v2/health/ready",
    "/v2/models/simple",
    "/v2/models/simple/versions/1",
    "/v2/models/simple/ready",
    "/v2/models/simple/versions/1/ready",
    "/v2/models/simple/config",
    "/v2/models/simple/versions/9/config",
    "/v2/models/nope",
    "/v2/models/nope/ready",
    "/v2/models/a..b/config",
]


def test_inference_is_the_fronts_and_a_connection_goes_to_aiohttp_at_another_route(
    run_appliance: Any, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    srv = run_appliance(new_loop=new_loop)
    with _connect(srv) as sock:
        responses = Responses(sock)
        sock.sendall(_infer(_simple(1)))
        status, headers, body = responses.read()
        assert status == 200 and _sum(body) == [2] * 16
        assert "server" not in headers  # the front answered
        assert headers["content-type"] == "application/json" and "date" in headers
        sock.sendall(GET_READY)
        status, headers, _ = responses.read()
        assert status == 200 and "aiohttp" in headers["server"]
        sock.sendall(_infer(_simple(3)))  # the same connection, aiohttp's now
        status, headers, body = responses.read()
        assert status == 200 and _sum(body) == [6] * 16 and "aiohttp" in headers["server"]


def test_the_read_only_routes_are_the_fronts_and_answer_as_aiohttp_does(
    run_appliance: Any, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    """Each read-only route asked of the front (keep-alive, one connection) and of
    aiohttp (the same route with a query string, which hands a connection over): the
    same status and the same document."""
    srv = run_appliance(new_loop=new_loop)
    statuses = {}
    with _connect(srv) as front, _connect(srv) as behind:
        ours, theirs = Responses(front), Responses(behind)
        for path in READS:
            front.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
            status, headers, body = ours.read()
            assert "server" not in headers, path  # the front answered
            behind.sendall(f"GET {path}?q=1 HTTP/1.1\r\nHost: t\r\n\r\n".encode())
            status2, headers2, body2 = theirs.read()
            assert "aiohttp" in headers2["server"], path
            assert status == status2, (path, body, body2)
            assert (json.loads(body) if body else None) == (json.loads(body2) if body2 else None)
            if body:
                assert headers["content-type"] == "application/json", path
            statuses[path] = status
    # (and the answers are the routes' own: found, not found, not ready, malformed)
    assert [statuses[p] for p in READS] == [200] * 9 + [404, 400, 400, 400]


def test_pipelined_requests_are_answered_in_order(
    run_appliance: Any, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    srv = run_appliance(new_loop=new_loop)
    values = [1, 2, 3, 4]
    with _connect(srv) as sock:
        responses = Responses(sock)
        # four inferences, a route of aiohttp's in the middle of them, in one send
        sock.sendall(
            _infer(_simple(1))
            + _infer(_simple(2))
            + GET_READY
            + _infer(_simple(3))
            + _infer(_simple(4))
        )
        answers = [responses.read() for _ in range(5)]
    assert [a[0] for a in answers] == [200] * 5
    sums = [_sum(a[2]) for i, a in enumerate(answers) if i != 2]
    assert sums == [[2 * v] * 16 for v in values]
    assert answers[2][2] == b""  # the readiness answer, in its place


def test_a_request_sent_a_byte_at_a_time_is_served(
    run_appliance: Any, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    srv = run_appliance(new_loop=new_loop)
    request = _infer(_simple(5))
    with _connect(srv) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(request)):
            sock.send(request[i : i + 1])
        status, headers, body = Responses(sock).read()
    assert status == 200 and _sum(body) == [10] * 16 and "server" not in headers


def test_a_binary_request_of_many_segments_is_served(
    run_appliance: Any, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    srv = run_appliance(new_loop=new_loop)
    image = np.random.default_rng(7).random((1, 3, 224, 224), dtype=np.float32)
    tensor = httpclient.InferInput("input", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image, binary_data=True)
    out = httpclient.InferRequestedOutput("output", binary_data=True)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        [tensor], outputs=[out]
    )
    assert json_size is not None
    extra = f"Inference-Header-Content-Length: {json_size}\r\n".encode()
    with _connect(srv) as sock:
        responses = Responses(sock)
        for _ in range(2):  # the second on the same connection
            # a small request right behind the big body, in the same send
            sock.sendall(_infer(body, "classifier", extra) + _infer(_simple(4)))
            status, headers, answer = responses.read()
            assert status == 200, answer
            assert "server" not in headers
            length = int(headers["inference-header-content-length"])
            header = json.loads(answer[:length])
            assert header["outputs"][0]["shape"] == [1, 1000]
            scores = np.frombuffer(answer[length:], dtype=np.float32)
            assert scores.shape == (1000,) and np.isfinite(scores).all()
            status, _, answer = responses.read()
            assert status == 200 and _sum(answer) == [8] * 16


def test_a_request_refused_before_its_body_keeps_the_connection(
    run_appliance: Any, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    srv = run_appliance(new_loop=new_loop)
    body = _simple(1)
    with _connect(srv) as sock:
        responses = Responses(sock)
        head, _, rest = _infer(body, "no_such_model").partition(b"\r\n\r\n")
        sock.sendall(head + b"\r\n\r\n")  # the answer may come before the body is sent
        sock.sendall(rest)
        status, _, answer = responses.read()
        assert status == 400 and "no_such_model" in json.loads(answer)["error"]
        sock.sendall(_infer(_simple(2)))  # the refused body was dropped, not parsed
        status, headers, answer = responses.read()
        assert status == 200 and _sum(answer) == [4] * 16 and "server" not in headers


def test_tokens_are_checked_by_the_front(run_appliance: Any) -> None:
    srv = run_appliance(inference_token="s3cret-inference-token")
    with _connect(srv) as sock:
        responses = Responses(sock)
        sock.sendall(_infer(simple_body()))
        status, headers, answer = responses.read()
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert "token" in json.loads(answer)["error"]
        sock.sendall(
            _infer(simple_body(), extra=b"Authorization: Bearer s3cret-inference-token\r\n")
        )
        status, headers, answer = responses.read()
        assert status == 200 and _sum(answer) == [2] * 16


def test_connection_close_is_honoured(run_appliance: Any) -> None:
    srv = run_appliance()
    with _connect(srv) as sock:
        sock.sendall(_infer(simple_body(), extra=b"Connection: close\r\n"))
        status, headers, _ = Responses(sock).read()
        assert status == 200 and headers["connection"] == "close"
        assert sock.recv(1) == b""  # and the server closed it


# ---- heads the front does not take (aiohttp answers them) ----------------------------

ORDINARY = b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n"
ODD_HEADS = {
    "chunked": ORDINARY.replace(b"Content-Length: 2", b"Transfer-Encoding: chunked"),
    "length-and-chunked": ORDINARY.replace(b"Host", b"Transfer-Encoding: chunked\r\nHost"),
    "two-lengths": ORDINARY.replace(b"Host: t", b"Content-Length: 2\r\nHost: t"),
    "signed-length": ORDINARY.replace(b"Length: 2", b"Length: +2"),
    "no-length": ORDINARY.replace(b"Content-Length: 2\r\n", b""),
    "expect": ORDINARY.replace(b"Host", b"Expect: 100-continue\r\nHost"),
    "upgrade": ORDINARY.replace(b"Host", b"Connection: Upgrade\r\nUpgrade: h2c\r\nHost"),
    "folded": ORDINARY.replace(b"Host: t\r\n", b"Host: t\r\n folded\r\n"),
    "space-before-colon": ORDINARY.replace(b"Host: t", b"Host : t"),
    "non-ascii": ORDINARY.replace(b"Host: t", b"Host: t\xe9"),
    "http10": ORDINARY.replace(b"HTTP/1.1", b"HTTP/1.0"),
    "lower-method": ORDINARY.replace(b"POST", b"post"),
    "percent-name": ORDINARY.replace(b"simple", b"sim%70le"),
    "query": ORDINARY.replace(b"/infer", b"/infer?x=1"),
    "dot-name": ORDINARY.replace(b"simple", b".."),
    "version-word": ORDINARY.replace(b"/infer", b"/versions/one/infer"),
    "two-header-lengths": ORDINARY.replace(
        b"Host", b"Inference-Header-Content-Length: 1\r\nInference-Header-Content-Length: 2\r\nHost"
    ),
    "bare-lf": ORDINARY.replace(b"Host: t\r\n", b"Host: t\n"),
}


@pytest.mark.parametrize("name", sorted(ODD_HEADS))
def test_the_front_leaves_odd_heads_to_aiohttp(name: str) -> None:
    assert http_head.parse(ODD_HEADS[name]) is None


def test_the_front_takes_ordinary_heads() -> None:
    head = http_head.parse(
        b"POST /v2/models/my-model_2.onnx/versions/3/infer HTTP/1.1\r\nhost: t\r\n"
        b"content-length: 17\r\nInference-Header-Content-Length: 9 \r\n"
        b"Authorization: Bearer a\r\nConnection: keep-alive, close\r\nAccept:\r\n\r\n"
    )
    fields = ((b"host", b"t"), (b"Accept", b""))  # the others, as sent: to forward as parameters
    assert head == http_head.Head(
        "my-model_2.onnx", "3", 17, "9", ("Bearer a",), False, fields, http_head.INFER
    )
    assert head is not None and list(head.headers()) == [("host", "t"), ("Accept", "")]


def test_odd_heads_get_an_answer_and_the_server_keeps_serving(run_appliance: Any) -> None:
    srv = run_appliance()
    for name, head in sorted(ODD_HEADS.items()):
        with _connect(srv) as sock:
            sock.sendall(head + b"{}")
            sock.shutdown(socket.SHUT_WR)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        if received:  # aiohttp may also just close a connection it cannot read
            status = int(received.split(b" ", 2)[1])
            assert 100 <= status < 500, (name, received[:300])
        with _connect(srv) as sock:
            sock.sendall(_infer(_simple(1)))
            status, _, body = Responses(sock).read()
            assert status == 200 and _sum(body) == [2] * 16, name
