"""Shared pieces of the gRPC endpoint's tests (test_grpc_h2.py and the hostile-peer
tests test_grpc_h2_hostile.py, test_grpc_h2_peers.py, test_grpc_calls_hostile.py): the
models they serve, a server with them, the rule that no hostile-peer test may log an
error, a well-behaved client that keeps calling during an attack (:class:`Bystander`),
and request helpers over tests/h2_peer.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from h2_peer import LIVE, Peer
from tritonclient.grpc import service_pb2

from devtools import modelgen

IDENTITY = """\
max_batch_size: 4
input:
  - {name: INPUT0, data_type: TYPE_FP32, dims: [-1]}
output:
  - {name: OUTPUT0, data_type: TYPE_FP32, dims: [-1]}
"""
# a lone request waits this long for a batch: a call that stays in flight
SLOW = IDENTITY.replace("max_batch_size: 4", "max_batch_size: 8") + (
    "dynamic_batching: {preferred_batch_size: [8], max_queue_delay_microseconds: 5000000}\n"
)


@pytest.fixture
def no_error_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A hostile peer is answered, never a crash: no record at ERROR or above."""
    caplog.set_level(logging.INFO)
    yield
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


@pytest.fixture
def serve(run_appliance: Any, tmp_path: Path) -> Callable[..., Any]:
    """``serve(**server_options)``: a real server with ``identity`` and ``slow``."""
    modelgen.write_model(tmp_path, "identity", modelgen.identity("FP32", [-1]), IDENTITY)
    modelgen.write_model(tmp_path, "slow", modelgen.identity("FP32", [-1]), SLOW)

    def start(**options: Any) -> Any:
        return run_appliance(tmp_path, **options)

    return start


def status(fields: dict[str, str]) -> str:
    """An answer's grpc-status, or "rst <code>" for a reset stream."""
    return fields.get("grpc-status", f"rst {fields.get('rst')}")


def live(peer: Peer, sid: int) -> str:
    """A ServerLive call on ``sid``: its grpc-status ("0": the connection still serves)."""
    peer.send(peer.call(sid, LIVE))
    return status(peer.answer(sid)[0])


def connection_error(url: str, *frames: bytes, **peer: Any) -> tuple[int, bytes]:
    """A fresh connection sends ``frames``: the server's GOAWAY (code, debug data)."""
    with Peer(url, **peer) as p:
        p.send(*frames)
        got = p.goaway()
        return got.code, got.debug


def infer_request(model: str = "identity", elements: int = 4) -> bytes:
    """A serialized ModelInferRequest: one FP32 input ``INPUT0`` of shape [1, elements]."""
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, elements])
    request.raw_input_contents.append(np.arange(elements, dtype=np.float32).tobytes())
    return bytes(request.SerializeToString())


class Bystander:
    """A well-behaved ``tritonclient.grpc`` client calling ModelInfer on ``identity`` on
    its own thread while a test attacks the server (at most ``limit`` calls, a pause
    between them; ``token``: sent as its bearer token). As a context manager: its first
    call is made before the body runs, every call must succeed, and one more succeeds
    after the body."""

    def __init__(self, url: str, limit: int = 20000, token: str = "") -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self._headers = {"authorization": f"Bearer {token}"} if token else None
        self.calls = 0
        self.errors: list[BaseException] = []
        self._limit = limit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bystander", daemon=True)

    def infer(self) -> None:
        row = np.arange(4, dtype=np.float32).reshape(1, 4)
        tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        tensor.set_data_from_numpy(row)
        result = self.client.infer("identity", [tensor], client_timeout=60, headers=self._headers)
        got = result.as_numpy("OUTPUT0")
        np.testing.assert_array_equal(got, row)
        self.calls += 1

    def _run(self) -> None:
        while not self._stop.wait(0.005) and self.calls < self._limit:
            try:
                self.infer()
            except BaseException as exc:  # reported by __exit__
                self.errors.append(exc)
                return

    def __enter__(self) -> Bystander:
        self.infer()
        self._thread.start()
        return self

    def __exit__(self, kind: Any, *rest: Any) -> None:
        self._stop.set()
        self._thread.join(120)
        if kind is None:
            assert not self.errors, f"the well-behaved client failed: {self.errors[:3]}"
            self.infer()
        self.client.close()
