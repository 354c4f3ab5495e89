"""Graceful shutdown under load: SIGTERM to a real `appliance serve` process while
keep-alive clients post requests.

What must hold (no timing assertions): every request whose bytes were written
before the signal was sent gets an HTTP response (200, or 503 "shutting down"),
never a reset or a closed connection; an idle keep-alive connection is closed by
the server; the process exits with code 0. The drain timeout is set to 600 s and
the test waits far less for the exit, so a shutdown that sits out the timeout
instead of the in-flight work fails it.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from http_helpers import metric_value
from mosquitto import wait_until
from serve_process import start_serve

from devtools import modelgen

REQUEST = json.dumps(
    {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
            {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
        ]
    }
).encode()
CLIENTS = 16
EXIT_WAIT_S = 120  # generous: the drain timeout is 600 s, the in-flight work far less


def test_sigterm_under_load_answers_every_accepted_request(tmp_path: Path) -> None:
    # a short batching delay keeps requests queued at every moment of the load
    modelgen.write_model(
        tmp_path / "repo",
        "simple",
        modelgen.simple_add_sub(),
        "max_batch_size: 8\ndynamic_batching: {max_queue_delay_microseconds: 20000}\n",
    )
    config = tmp_path / "appliance.yaml"
    config.write_text("drain_timeout_s: 600\n")
    proc, port, lines = start_serve(
        "--config",
        str(config),
        "--model-repository",
        str(tmp_path / "repo"),
        "--metrics-port",
        "-1",
    )
    lock = threading.Lock()
    killed = [False]
    answered = threading.Semaphore(0)
    outcomes: list[tuple[bool, str]] = []  # (written before the signal, outcome)

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=EXIT_WAIT_S)
        for _ in range(2000):  # bounded; ends at the first connection error after the signal
            try:
                conn.request("POST", "/v2/models/simple/infer", REQUEST)
            except OSError as exc:
                with lock:
                    before = not killed[0]
                outcomes.append((before, f"send failed: {exc!r}"))
                return
            with lock:
                before = not killed[0]  # the whole request was written before the signal
            try:
                response = conn.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException) as exc:
                outcomes.append((before, f"no response: {exc!r}"))
                return
            if response.status == 200:
                assert json.loads(body)["outputs"][0]["data"] == list(range(1, 17))
            else:
                assert response.status == 503, body
                assert b"shutting down" in body, body
            outcomes.append((before, str(response.status)))
            answered.release()
            if response.status == 503 or response.will_close:
                return

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    idle = socket.create_connection(("127.0.0.1", port), timeout=EXIT_WAIT_S)
    upload = socket.create_connection(("127.0.0.1", port), timeout=EXIT_WAIT_S)
    try:
        idle.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")  # now an idle keep-alive connection
        for t in threads:
            t.start()
        for _ in range(100):  # the load is under way (bounded)
            assert answered.acquire(timeout=60), "the load did not get going"
        # a request whose body is half sent when the signal comes
        upload.sendall(
            b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(REQUEST)
            + REQUEST[:100]
        )
        with lock:
            killed[0] = True
            proc.send_signal(signal.SIGTERM)
        assert idle.recv(4096) == b""  # the server closed the idle connection (not a reset)
        # the rest of the body, sent once the server is closing connections: still
        # read, and the request answered
        upload.sendall(REQUEST[100:])
        head = upload.recv(4096)
        assert head.startswith((b"HTTP/1.1 200", b"HTTP/1.1 503")), head
        assert proc.wait(EXIT_WAIT_S) == 0
        for t in threads:
            t.join(EXIT_WAIT_S)
    finally:
        idle.close()
        upload.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    accepted = [outcome for before, outcome in outcomes if before]
    assert accepted and all(o in ("200", "503") for o in accepted), [
        o for o in accepted if o not in ("200", "503")
    ]
    assert "stopped" in "".join(lines)


def test_grpc_call_in_flight_is_answered_and_stop_does_not_sit_out_the_timeout(
    run_appliance: Any, tmp_path: Path
) -> None:
    # a lone request waits 2 s for a batch: it is in flight when the server stops
    modelgen.write_model(
        tmp_path,
        "slow",
        modelgen.identity("FP32", [-1]),
        "max_batch_size: 8\ndynamic_batching: {max_queue_delay_microseconds: 2000000}\n",
    )
    srv = run_appliance(tmp_path, drain_timeout_s=600)
    result: list[Any] = []

    def call() -> None:
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        x = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
        x.set_data_from_numpy(np.ones((1, 1), np.float32))
        try:
            result.append(client.infer("slow", [x], client_timeout=EXIT_WAIT_S))
        except Exception as exc:  # reported by the assert below
            result.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    wait_until(lambda: _pending(srv) == 1, what="the call to wait in the model's queue")
    srv.call(srv.server.stop(), timeout=EXIT_WAIT_S)  # far below the 600 s drain timeout
    caller.join(EXIT_WAIT_S)
    assert result and not isinstance(result[0], Exception), result
    np.testing.assert_array_equal(result[0].as_numpy("OUTPUT0"), [[1.0]])


def _pending(srv: Any) -> int:
    held = metric_value(
        srv.metrics_url, "nv_inference_pending_request_bytes", model="slow", version="1"
    )
    return int(bool(held))
