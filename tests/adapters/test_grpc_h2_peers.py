"""The gRPC endpoint against slow, silent, greedy and too many peers: flow control
(a client past the window it was granted: FLOW_CONTROL_ERROR; a message bigger than the
window still passes), a client that never reads (CVE-2019-9517 class: the server stops
reading it and drops it), slowloris (no preface, half a frame, half a header block,
SETTINGS never acknowledged, an idle connection: GOAWAY), and the connection limit
(GOAWAY ENHANCE_YOUR_CALM). Raw frames on a real loopback socket (tests/h2_peer.py);
a well-behaved tritonclient.grpc client keeps being served during and after.

No test asserts a duration: timeouts are configured small and the outcome is checked.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_helpers import Bystander, infer_request, live, no_error_logged, serve, status
from h2_peer import (
    DATA,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    INFER,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_TIMEOUT,
    STREAM_INFER,
    Peer,
    frame,
    grpc_message,
    request_headers,
    settings,
    window_update,
)

from appliance.adapters.grpc.h2.limits import H2Limits
from appliance.adapters.grpc.server import grpc_limits
from appliance.config.server_config import ServerConfig, load_server_config

__all__ = ["no_error_logged", "serve"]  # fixtures
pytestmark = pytest.mark.usefixtures("no_error_logged")


def test_flow_control_is_enforced_and_a_stream_message_may_exceed_the_window(
    serve: Any,
) -> None:
    """A client that sends past the window the server granted gets FLOW_CONTROL_ERROR
    (the server held the window: a streaming call that cannot answer stops reading);
    a message bigger than the stream window still passes (the window of a message in
    progress is given back as it arrives)."""
    server = serve()
    url = server.grpc_url
    with Bystander(url):
        with Peer(url) as p:
            p.send(settings(s4=0))  # the server may send no DATA: its answers wait
            p.send(p.headers(1, request_headers(STREAM_INFER)))
            message = grpc_message(infer_request("identity", 16384))  # 64 KiB each
            chunks = [message[i : i + 16384] for i in range(0, len(message), 16384)]
            frames = [frame(DATA, 0, 1, c) for c in chunks]
            p.send_many(frames * 400)  # 25 MiB: past 64 calls in flight and 16 MiB unread
            got = p.until(RST_STREAM, 1)
            assert got.code == FLOW_CONTROL_ERROR, got
            p.send(p.headers(3, request_headers()), window_update(3, 1000))
            p.send(frame(DATA, END_STREAM, 3, grpc_message(b"")))
            assert status(p.answer(3)[0]) == "0"
        client = grpcclient.InferenceServerClient(url)
        results: list[Any] = []
        client.start_stream(lambda result, error: results.append((result, error)))
        big = np.arange(5 * 2**20, dtype=np.float32).reshape(1, -1)  # 20 MiB
        tensor = grpcclient.InferInput("INPUT0", list(big.shape), "FP32")
        tensor.set_data_from_numpy(big)
        client.async_stream_infer("identity", [tensor])
        deadline = time.monotonic() + 120
        while not results and time.monotonic() < deadline:
            time.sleep(0.05)
        client.stop_stream()
        assert results and results[0][1] is None, results
        np.testing.assert_array_equal(results[0][0].as_numpy("OUTPUT0"), big)


def test_a_peer_that_never_reads_stops_being_read_and_is_dropped(serve: Any) -> None:
    """CVE-2019-9517 class: a client asks for big answers and reads none. Once the
    write buffer is past its high-water mark the server reads nothing more from the
    connection (no more work for it), and drops it once the client has taken nothing
    for ``grpc_read_timeout_s``."""
    server = serve(grpc_read_timeout_s=1.0)
    endpoint = server.server._grpc
    with Bystander(server.grpc_url):
        before = set(endpoint.connections)
        hostile = Peer(server.grpc_url, receive_buffer=4096)
        (served,) = set(endpoint.connections) - before  # the server's side of it
        hostile.send(settings(s4=2**31 - 1), window_update(0, 2**31 - 1 - 65535))
        body = infer_request("identity", 65536)  # 256 KiB each way
        hostile.sock.settimeout(5)  # a send the server does not take ends a loop below

        def waiting(until: Any) -> None:
            deadline = time.monotonic() + 60
            while not until() and time.monotonic() < deadline:
                time.sleep(0.01)

        def gone() -> bool:
            return served not in endpoint.connections

        def answered(n: int) -> bool:
            return served.machine.watch.opened >= n and not served.streams and not served.calls

        sid = -1
        for n in range(1, 65):  # calls, one at a time, until the server's writes back up
            sid += 2
            assert hostile.send(hostile.call(sid, INFER, body))
            waiting(lambda n=n: served._paused or gone() or answered(n))
            if served._paused or gone():
                break
        assert served._paused or gone(), "64 answers of 256 KiB fit in the write buffer"
        opened = served.machine.watch.opened
        for _ in range(8):  # more requests: the server must not read them
            sid += 2
            if not hostile.send(hostile.call(sid, INFER, body)):
                break
        waiting(gone)
        assert gone(), "the client that does not read is kept"
        read = served.machine.watch.opened
        assert read == opened, "requests were read while the writes were backed up"
        hostile.close()


def test_slow_and_silent_peers_are_closed(serve: Any) -> None:
    """Slowloris: no preface, half a frame, half a header block, SETTINGS never
    acknowledged, and a connection without calls: each is closed with GOAWAY."""
    server = serve(grpc_read_timeout_s=1.0, grpc_idle_timeout_s=2.0)
    url = server.grpc_url
    with Bystander(url):
        silent = Peer(url, handshake=False)
        half_frame = Peer(url)
        half_frame.send(b"\x00\x00\x10\x00")
        half_block = Peer(url)
        half_block.send(frame(HEADERS, 0, 1, half_block.block(request_headers())[:4]))
        no_ack = Peer(url, ack=False)
        idle = Peer(url)
        assert live(idle, 1) == "0"
        got = {
            name: peer.goaway()
            for name, peer in {
                "no preface": silent,
                "half a frame": half_frame,
                "half a header block": half_block,
                "no SETTINGS ACK": no_ack,
                "idle": idle,
            }.items()
        }
        for peer in (silent, half_frame, half_block, no_ack, idle):
            peer.close()
    codes = {name: frame_.code for name, frame_ in got.items()}
    assert codes == {
        "no preface": 0,
        "half a frame": 0,
        "half a header block": 0,
        "no SETTINGS ACK": SETTINGS_TIMEOUT,
        "idle": 0,
    }, codes
    assert b"preface" in got["no preface"].debug
    assert b"frame" in got["half a frame"].debug
    assert b"header block" in got["half a header block"].debug
    assert got["idle"].last_stream == 1


def test_too_many_connections_are_turned_away(serve: Any) -> None:
    server = serve(grpc_max_connections=3)
    url = server.grpc_url
    endpoint = server.server._grpc
    with Bystander(url):
        first, second = Peer(url), Peer(url)
        with Peer(url, handshake=False) as third:
            third.send(PREFACE + frame(SETTINGS, 0, 0))
            kinds = []
            for got in third.frames():
                kinds.append(got.kind)
                if got.kind == GOAWAY:
                    assert got.code == ENHANCE_YOUR_CALM and b"too many" in got.debug
            assert kinds == [SETTINGS, GOAWAY] and third.eof
        assert live(first, 1) == "0"
        second.close()
        deadline = time.monotonic() + 30
        while len(endpoint.connections) > 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        with Peer(url) as again:
            assert live(again, 1) == "0"
        first.close()


def test_grpc_limits_come_from_the_server_config() -> None:
    assert grpc_limits(ServerConfig()) == H2Limits()  # the config's defaults are the server's
    cfg = load_server_config(
        None,
        {
            "grpc_max_connections": 8,
            "grpc_max_concurrent_streams": 16,
            "grpc_max_header_list_size": "8KiB",
            "grpc_idle_timeout_s": 60,
            "grpc_read_timeout_s": 5,
        },
    )
    assert grpc_limits(cfg) == H2Limits(
        max_connections=8,
        max_concurrent_streams=16,
        max_header_list_size=8192,
        idle_timeout_s=60.0,
        read_timeout_s=5.0,
    )
