"""Attack class: HTTP peers that hold the device's sockets and memory, and HTTP odds.

Oversized declared bodies (with and without ``Expect: 100-continue``), clients
that dribble their header or body a byte at a time, clients that leave in the
middle of a body; plus the KServe spellings and answers an honest client relies
on. No test asserts a duration: a slow peer must be *closed by the server* (with
a small configured timeout) while another client is still answered, and the
``run_appliance`` fixture fails a test whose requests blocked the event loop.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from http_helpers import read_response, simple_body

from appliance.config.server_config import load_server_config

SAFETY_S = 20.0  # a bound on waiting for the server, never a pass/fail on time


def _connect(srv: Any) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=SAFETY_S)


def _closed_by_server(sock: socket.socket, dribble: bytes = b"") -> bytes:
    """Send ``dribble`` a byte at a time (one every 50 ms) until the server closes the
    connection; return what the server sent meanwhile. Fails if it never closes."""
    received = b""
    deadline = time.monotonic() + SAFETY_S
    i = 0
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return received
            if not chunk:
                return received
            received += chunk
            continue
        if dribble:
            try:
                sock.send(dribble[i % len(dribble) : i % len(dribble) + 1])
            except (BrokenPipeError, ConnectionResetError):
                return received
            i += 1
    raise AssertionError(f"the server kept the connection open; it sent {received[:200]!r}")


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=SAFETY_S) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


# ---- sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v2/models/simple/infer", "/v2/repository/models/simple/load"])
@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect-100-continue"])
def test_a_declared_oversized_body_is_refused_before_it_is_read(
    run_appliance: Any, path: str, expect: bool
) -> None:
    srv = run_appliance(max_request_size="1MiB")
    with _connect(srv) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 2147483648\r\n"
        if expect:
            head += "Expect: 100-continue\r\n"
        sock.sendall(head.encode() + b"\r\n" + (b"" if expect else b"{}"))
        status, headers, body = read_response(sock)  # without the other 2 GB being sent
        assert status == 413, body
        assert "max_request_size" in json.loads(body)["error"]
        assert headers.get("connection", "").lower() == "close"
    # a body within the limit is still served, with and without Expect
    with _connect(srv) as sock:
        payload = simple_body()
        sock.sendall(
            b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        )
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(payload)
        status, _, body = read_response(sock)
        assert status == 200, body


# ---- slow peers -----------------------------------------------------------------------


def test_a_client_dribbling_its_header_is_closed(run_appliance: Any) -> None:
    srv = run_appliance(http_header_timeout_s=0.3)
    with _connect(srv) as slow, _connect(srv) as silent:
        request = b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 10_000
        slow.sendall(request[:5])
        # meanwhile an ordinary client is answered
        status, _, _ = _get(f"http://{srv.url}/v2/health/live")
        assert status == 200
        assert _closed_by_server(slow, request[5:]) == b""  # closed, nothing answered
        assert _closed_by_server(silent) == b""  # connected and never said a word


def test_an_idle_keep_alive_connection_is_closed_after_its_answer(run_appliance: Any) -> None:
    srv = run_appliance(http_header_timeout_s=0.3)
    with _connect(srv) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
        status, headers, _ = read_response(sock)
        assert status == 200 and headers.get("connection", "").lower() != "close"
        assert _closed_by_server(sock) == b""


def test_a_client_dribbling_its_body_gets_408_and_is_closed(run_appliance: Any) -> None:
    srv = run_appliance(http_body_timeout_s=0.3)
    payload = simple_body()
    with _connect(srv) as slow:
        slow.sendall(
            b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: t\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload[:3]
        )
        status, _, _ = _get(f"http://{srv.url}/v2/models/simple/ready")
        assert status == 200  # another client is answered meanwhile
        received = _closed_by_server(slow, payload[3:])
        assert received.startswith(b"HTTP/1.1 408"), received[:200]
        assert b"http_body_timeout_s" in received


def test_normal_clients_are_served_with_the_default_timeouts(run_appliance: Any) -> None:
    srv = run_appliance()
    assert srv.server.config.http_header_timeout_s == 30.0
    assert srv.server.config.http_body_timeout_s == 60.0
    with _connect(srv) as sock:  # one keep-alive connection, several requests
        for _ in range(3):
            payload = simple_body()
            sock.sendall(
                b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: t\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            status, _, body = read_response(sock)
            assert status == 200, body
            assert json.loads(body)["outputs"][0]["data"] == [2] * 16


def test_a_client_leaving_mid_body_is_a_debug_event(
    run_appliance: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="appliance")
    srv = run_appliance()
    with _connect(srv) as sock:
        sock.sendall(
            b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        # the server asks for the body once a handler has taken the request (a client
        # gone before that was never a request: nothing to notice), so the client below
        # leaves in the middle of a body the server is reading, whatever the load
        interim = b""
        while b"\r\n\r\n" not in interim:
            chunk = sock.recv(4096)
            assert chunk, f"closed before the 100 Continue: {interim!r}"
            interim += chunk
        assert interim.startswith(b"HTTP/1.1 100 Continue"), interim
        sock.sendall(b'{"inputs": [')
    deadline = time.monotonic() + SAFETY_S
    while not any("left" in r.getMessage() for r in caplog.records if r.name.startswith("appl")):
        assert time.monotonic() < deadline, "the server never noticed the client leaving"
        time.sleep(0.05)
    assert _get(f"http://{srv.url}/v2/health/live")[0] == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [(r.name, r.getMessage()) for r in errors]


# ---- the KServe spellings -------------------------------------------------------------


def test_v2_with_a_trailing_slash_is_server_metadata(run_appliance: Any) -> None:
    srv = run_appliance()
    status, _, body = _get(f"http://{srv.url}/v2/")
    assert status == 200 and json.loads(body) == json.loads(_get(f"http://{srv.url}/v2")[2])


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v2/models/simple/infer", {"POST"}),
        ("POST", "/v2/health/live", {"GET", "HEAD"}),
        ("PUT", "/v2/repository/index", {"POST"}),
    ],
)
def test_405_says_which_methods_are_allowed(
    run_appliance: Any, method: str, path: str, allowed: set[str]
) -> None:
    srv = run_appliance()
    request = urllib.request.Request(f"http://{srv.url}{path}", method=method, data=None)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=SAFETY_S)
    assert info.value.code == 405
    assert {m.strip() for m in info.value.headers["Allow"].split(",")} == allowed
    assert json.loads(info.value.read())["error"]


def test_model_ready_answers_carry_the_usual_json_error(
    run_appliance: Any, test_repository: Path
) -> None:
    srv = run_appliance(test_repository)
    status, _, body = _get(f"http://{srv.url}/v2/models/nope/ready")
    # Triton's answer for an unknown model: 400 with its usual text
    assert status == 400
    assert json.loads(body)["error"] == "Request for unknown model: 'nope' is not found"
    status, _, body = _get(f"http://{srv.url}/v2/models/broken_config/ready")
    assert status == 400 and "broken_config" in json.loads(body)["error"]
    status, _, body = _get(f"http://{srv.url}/v2/models/simple/versions/7/ready")
    assert status == 404 and json.loads(body)["error"]
    status, _, body = _get(f"http://{srv.url}/v2/models/simple/ready")
    assert status == 200 and body == b""


def test_the_documented_settings_are_the_defaults(tmp_path: Path) -> None:
    """The YAML block of docs/security.md (pasted in the README) loads, and says the
    defaults."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    block = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "appliance.yaml"
    path.write_text(block)
    documented = load_server_config(path, {})
    defaults = load_server_config(None, {})
    for key in ("max_request_size", "max_request_elements", "http_header_timeout_s",
                "http_body_timeout_s", "allow_symlinked_models", "grpc_max_connections",
                "grpc_max_concurrent_streams", "grpc_max_header_list_size",
                "grpc_idle_timeout_s", "grpc_read_timeout_s"):
        assert getattr(documented, key) == getattr(defaults, key), key
        assert key in block


def test_tritonclient_keeps_working_across_idle_closes(run_appliance: Any) -> None:
    """tritonclient's pooled keep-alive connection is closed by the server while idle;
    the next call reconnects (it retries a connection closed by the peer)."""
    srv = run_appliance(http_header_timeout_s=0.2)
    client = httpclient.InferenceServerClient(srv.url)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(np.ones((1, 16), np.int32))
    for _ in range(3):
        result = client.infer("simple", inputs)
        assert result.as_numpy("OUTPUT0").tolist() == [[2] * 16]
        time.sleep(0.5)  # idle past the timeout: the server closes the connection
