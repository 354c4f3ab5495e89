"""The gRPC endpoint's own HTTP/2 and gRPC layers (appliance/adapters/grpc/h2/connection.py,
grpc_calls.py) against the real grpcio client (tritonclient's) and raw sockets:
big messages both ways (flow control, frame splitting), compressed requests,
deadlines, cancellation, many calls on one connection, unknown methods, health,
and peers that do not speak HTTP/2."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_helpers import IDENTITY, SLOW
from tritonclient.utils import InferenceServerException

from appliance.adapters.grpc import health_proto as health_pb2
from devtools import modelgen


class _HealthStub:
    """grpc.health.v1's client, as grpcio-health-checking's generated stub makes it (that
    package cannot be installed beside tritonclient[grpc]: see grpc_health_proto)."""

    def __init__(self, channel: grpc.Channel) -> None:
        def rpc(kind: str, name: str, reply: Any) -> Any:
            return getattr(channel, kind)(
                f"/grpc.health.v1.Health/{name}",
                request_serializer=lambda message: message.SerializeToString(),
                response_deserializer=reply.FromString,
            )

        self.Check = rpc("unary_unary", "Check", health_pb2.HealthCheckResponse)
        self.List = rpc("unary_unary", "List", health_pb2.HealthListResponse)
        self.Watch = rpc("unary_stream", "Watch", health_pb2.HealthCheckResponse)


health_pb2_grpc = SimpleNamespace(HealthStub=_HealthStub)


@pytest.fixture
def server(run_appliance: Any, tmp_path: Path) -> Any:
    modelgen.write_model(tmp_path, "identity", modelgen.identity("FP32", [-1]), IDENTITY)
    modelgen.write_model(tmp_path, "slow", modelgen.identity("FP32", [-1]), SLOW)
    return run_appliance(tmp_path, max_request_size="64MiB")


def _infer(
    client: grpcclient.InferenceServerClient, model: str, data: np.ndarray, **kw: Any
) -> Any:
    tensor = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return client.infer(model, [tensor], **kw).as_numpy("OUTPUT0")


def test_big_messages_both_ways_and_compressed_requests(server: Any) -> None:
    # 24 MiB each way: past the stream window (16 MiB) and the client's, in 16 KiB frames
    client = grpcclient.InferenceServerClient(server.grpc_url)
    big = np.random.default_rng(0).random((1, 6 * 2**20), dtype=np.float32)
    np.testing.assert_array_equal(_infer(client, "identity", big), big)
    for algorithm in ("gzip", "deflate"):
        small = np.arange(4096, dtype=np.float32).reshape(1, -1)
        got = _infer(client, "identity", small, compression_algorithm=algorithm)
        np.testing.assert_array_equal(got, small)


def test_many_calls_in_flight_on_one_connection(server: Any) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: list[Any] = []
    rows = [np.full((1, 32), i, np.float32) for i in range(64)]
    for row in rows:
        tensor = grpcclient.InferInput("INPUT0", [1, 32], "FP32")
        tensor.set_data_from_numpy(row)
        client.async_infer(
            "identity", [tensor], lambda result, error: results.append((result, error))
        )
    deadline = time.monotonic() + 60
    while len(results) < len(rows) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(results) == len(rows) and all(e is None for _, e in results)
    assert sorted(float(r.as_numpy("OUTPUT0")[0, 0]) for r, _ in results) == list(range(64))


def test_a_deadline_and_a_cancel_end_the_call_not_the_server(server: Any) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    row = np.ones((1, 4), np.float32)
    with pytest.raises(InferenceServerException) as info:
        _infer(client, "slow", row, client_timeout=0.3)
    assert "Deadline" in str(info.value) or "DEADLINE" in str(info.value.status())
    with grpc.insecure_channel(server.grpc_url) as channel:
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        request = service_pb2.ModelInferRequest(model_name="slow")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
        request.raw_input_contents.append(row.tobytes())
        future = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer.future(request)
        time.sleep(0.2)
        future.cancel()
        assert future.cancelled()
    np.testing.assert_array_equal(_infer(client, "identity", row), row)


def test_an_unknown_method_is_unimplemented(server: Any) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/NoSuchRpc")
        with pytest.raises(grpc.RpcError) as info:
            call(b"")
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "NoSuchRpc" in (info.value.details() or "")


def test_health_check_and_watch(server: Any) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        serving = health_pb2.HealthCheckResponse.SERVING
        listed = health.List(health_pb2.HealthListRequest(), timeout=10).statuses
        assert listed["inference.GRPCInferenceService"].status == serving
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def _raw(url: str, payload: bytes) -> bytes:
    host, port = url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(payload)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def _frame_types(data: bytes) -> list[int]:
    kinds, i = [], 0
    while i + 9 <= len(data):
        length = int.from_bytes(data[i : i + 3], "big")
        kinds.append(data[i + 3])
        i += 9 + length
    return kinds


def test_a_peer_that_does_not_speak_http2_is_closed(server: Any) -> None:
    # HTTP/1.1, or a frame bigger than allowed: GOAWAY (after the server's SETTINGS),
    # then the connection is closed
    kinds = _frame_types(_raw(server.grpc_url, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert kinds == [4, 8, 7], kinds  # SETTINGS, WINDOW_UPDATE, GOAWAY
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    huge = struct.pack(">I", 2**20)[1:] + bytes((0, 0)) + struct.pack(">I", 1)
    kinds = _frame_types(_raw(server.grpc_url, preface + huge))
    assert kinds[-1] == 7, kinds
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_server_ready()


def test_an_open_watch_ends_with_not_serving_when_the_endpoint_stops(server: Any) -> None:
    """Stopping turns health NOT_SERVING; a Watch gets it and then ends cleanly (status
    OK), instead of holding the shutdown until its grace runs out and being cancelled."""
    import threading

    from appliance.adapters.grpc.server import GrpcEndpoint

    endpoint = GrpcEndpoint(server.server.dataplane, "127.0.0.1", 0, 2**20)
    port = server.call(endpoint.start())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=60
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stopping = threading.Thread(target=server.call, args=(endpoint.stop(30.0),))
        stopping.start()
        rest = list(watch)  # ends without an RpcError: the server closed it with OK
        stopping.join()
    assert [r.status for r in rest] == [health_pb2.HealthCheckResponse.NOT_SERVING]
