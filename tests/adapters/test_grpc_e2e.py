"""End to end over gRPC with the unmodified tritonclient.grpc clients (sync, aio, stream),
plus raw ``ModelInferRequest`` messages for what tritonclient never sends."""

from __future__ import annotations

import asyncio
import os
import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)

PIPELINE = ("preprocess", "postprocess", "image_classifier")  # the demo camera pipeline


def _simple_inputs(a: np.ndarray = A, b: np.ndarray = B) -> list[grpcclient.InferInput]:
    inputs = [
        grpcclient.InferInput("INPUT0", list(a.shape), "INT32"),
        grpcclient.InferInput("INPUT1", list(b.shape), "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def _assert_simple_ok(client: grpcclient.InferenceServerClient) -> None:
    """A request after an error: the server still serves."""
    result = client.infer("simple", _simple_inputs())
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)


def _fails(call: Callable[[], Any], status: str, *words: str) -> None:
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == f"StatusCode.{status}", info.value
    for word in words:
        assert word in info.value.message(), info.value.message()


@pytest.fixture
def stub(run_appliance: Any) -> Iterator[tuple[Any, grpcclient.InferenceServerClient]]:
    """A raw stub (for hand-built messages) and a tritonclient on one demo server."""
    srv = run_appliance()
    with grpc.insecure_channel(srv.grpc_url) as channel:
        yield (
            service_pb2_grpc.GRPCInferenceServiceStub(channel),
            grpcclient.InferenceServerClient(srv.grpc_url),
        )


def _raw_request(*tensors: tuple[str, str, list[int]], model: str = "simple") -> Any:
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, datatype, shape in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    return request


def _rpc_fails(call: Callable[[], Any], code: grpc.StatusCode, *words: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error: Any = info.value
    assert error.code() == code, error.details()
    for word in words:
        assert word in error.details(), error.details()


def test_health_metadata_config_and_statistics(run_appliance: Any) -> None:
    srv = run_appliance()
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple") and not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    assert meta.name == "appliance" and "model_repository" in meta.extensions
    assert "system_shared_memory" not in meta.extensions  # off by default
    model = client.get_model_metadata("simple")
    assert model.platform == "onnxruntime_onnx" and list(model.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        ("INPUT0", "INT32", [-1, 16]),
        ("INPUT1", "INT32", [-1, 16]),
    ]
    config = client.get_model_config("simple").config
    assert config.name == "simple" and config.max_batch_size == 8
    assert config.input[0].data_type == grpcclient.model_config_pb2.TYPE_INT32
    assert list(config.output[1].dims) == [16]
    assert config.dynamic_batching.max_queue_delay_microseconds == 100
    client.infer("simple", _simple_inputs(np.ones((2, 16), np.int32), np.ones((2, 16), np.int32)))
    stats = client.get_inference_statistics("simple").model_stats[0]
    assert (stats.name, stats.version, stats.inference_count) == ("simple", "1", 2)
    assert stats.inference_stats.success.count == 1 and stats.inference_stats.compute_infer.ns > 0
    assert stats.batch_stats[0].batch_size == 2
    everything = client.get_inference_statistics().model_stats
    assert {s.name for s in everything} == {"simple", "classifier", *PIPELINE}
    _fails(
        lambda: client.get_model_metadata("nope"),
        "INVALID_ARGUMENT",
        "Request for unknown model: 'nope' is not found",
    )
    with grpc.insecure_channel(srv.grpc_url) as channel:  # grpc.health.v1, its wire bytes
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        for service in (b"", b"inference.GRPCInferenceService"):
            request = b"\n" + bytes([len(service)]) + service if service else b""
            assert check(request, timeout=10) == b"\x08\x01"  # status: SERVING


def test_simple_and_classifier(run_appliance: Any) -> None:
    srv = run_appliance()
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    result = client.infer("simple", _simple_inputs(), request_id="req-7")
    assert result.get_response().id == "req-7"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
    only = client.infer(
        "simple", _simple_inputs(), outputs=[grpcclient.InferRequestedOutput("OUTPUT1")]
    )
    assert [o.name for o in only.get_response().outputs] == ["OUTPUT1"]
    np.testing.assert_array_equal(only.as_numpy("OUTPUT1"), A - B)
    images = np.random.default_rng(0).random((2, 3, 224, 224), dtype=np.float32)
    inp = grpcclient.InferInput("input", list(images.shape), "FP32")
    inp.set_data_from_numpy(images)
    probs = client.infer("classifier", [inp]).as_numpy("output")
    assert probs.shape == (2, 1000)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-4)
    top = client.infer(
        "classifier", [inp], outputs=[grpcclient.InferRequestedOutput("output", class_count=3)]
    ).as_numpy("output")
    assert top.shape == (2, 3)
    assert [int(x.decode().split(":")[1]) for x in top[:, 0]] == list(np.argmax(probs, axis=1))


def _sample(datatype: str) -> np.ndarray:
    rng = np.random.default_rng(1)
    if datatype == "BYTES":
        return np.array([[b"hello", "wörld".encode(), b""]], dtype=object)
    if datatype == "BOOL":
        return rng.random((2, 3)) > 0.5
    names = {"FP16": "float16", "FP32": "float32", "FP64": "float64"}
    return (rng.random((2, 3)) * 100).astype(np.dtype(names.get(datatype, datatype.lower())))


# the InferTensorContents field of each datatype (FP16 has none)
CONTENTS = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def test_every_datatype_round_trips(run_appliance: Any, test_repository: Path) -> None:
    srv = run_appliance(test_repository)
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    with grpc.insecure_channel(srv.grpc_url) as channel:
        infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        for datatype in [*CONTENTS, "FP16"]:
            data = _sample(datatype)
            model = f"identity_{datatype.lower()}"
            inp = grpcclient.InferInput("INPUT0", list(data.shape), datatype)
            inp.set_data_from_numpy(data)
            got = client.infer(model, [inp]).as_numpy("OUTPUT0")  # raw_input_contents
            assert got.shape == data.shape, datatype
            if datatype == "BYTES":
                assert list(got.ravel()) == list(data.ravel())
            else:
                assert got.dtype == data.dtype, datatype
                np.testing.assert_array_equal(got, data)
            request = _raw_request(("INPUT0", datatype, list(data.shape)), model=model)
            if datatype == "FP16":  # no typed field exists: raw only
                request.inputs[0].contents.fp32_contents.extend(data.ravel().tolist())
                _rpc_fails(lambda r=request: infer(r), grpc.StatusCode.INVALID_ARGUMENT, "FP16")
                continue
            getattr(request.inputs[0].contents, CONTENTS[datatype]).extend(data.ravel().tolist())
            reply = infer(request)  # typed contents in, raw contents out
            raw = reply.raw_output_contents[0]
            if datatype == "BYTES":
                assert raw == b"".join(len(x).to_bytes(4, "little") + x for x in data.ravel())
            else:
                np.testing.assert_array_equal(
                    np.frombuffer(raw, data.dtype).reshape(data.shape), data
                )


def test_aio_client_concurrent_requests(run_appliance: Any) -> None:
    srv = run_appliance()

    async def main() -> list[np.ndarray]:
        async with aioclient.InferenceServerClient(srv.grpc_url) as client:
            assert await client.is_server_ready()
            calls = []
            for k in range(8):
                inputs = [aioclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
                inputs[0].set_data_from_numpy(A)
                inputs[1].set_data_from_numpy(np.full((1, 16), k, np.int32))
                calls.append(client.infer("simple", inputs))
            results = await asyncio.gather(*calls)
            return [r.as_numpy("OUTPUT0") for r in results]

    for k, out in enumerate(asyncio.run(main())):
        np.testing.assert_array_equal(out, A + k)


def test_stream_answers_in_order_and_reports_errors_in_stream(run_appliance: Any) -> None:
    srv = run_appliance()
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for k in range(20):
            b = np.full((1, 16), k, np.int32)
            if k == 10:  # wrong shape: this one fails, the stream goes on
                b = np.full((1, 15), k, np.int32)
            inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32")]
            inputs.append(grpcclient.InferInput("INPUT1", list(b.shape), "INT32"))
            inputs[0].set_data_from_numpy(A)
            inputs[1].set_data_from_numpy(b)
            # the last one asks to be marked final, as decoupled-aware clients do
            final = k == 19
            client.async_stream_infer(
                "simple", inputs, request_id=str(k), enable_empty_final_response=final
            )
        answers = [results.get(timeout=10) for _ in range(20)]
    finally:
        client.stop_stream()
    for k, (result, error) in enumerate(answers):
        if k == 10:
            assert result is None and "expected shape [-1, 16], got [1, 15]" in error.message()
            continue
        assert error is None, error
        response = result.get_response()
        assert response.id == str(k)  # in request order
        assert response.parameters["triton_final_response"].bool_param == (k == 19)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + k)
    _assert_simple_ok(client)


def test_repository_index_load_and_unload(run_appliance: Any) -> None:
    srv = run_appliance()
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    index = {(m.name, m.version, m.state) for m in client.get_model_repository_index().models}
    assert index == {(m, "1", "READY") for m in ("classifier", "simple", *PIPELINE)}
    client.unload_model("simple")
    assert not client.is_model_ready("simple")
    states = {m.name: m.state for m in client.get_model_repository_index().models}
    assert states["simple"] == "UNAVAILABLE"
    _fails(lambda: client.infer("simple", _simple_inputs()), "UNAVAILABLE", "not ready")
    client.load_model("simple")
    assert client.is_model_ready("simple")
    _assert_simple_ok(client)
    _fails(lambda: client.load_model("nope"), "NOT_FOUND", "'nope'")
    _fails(lambda: client.unload_model("nope"), "NOT_FOUND", "'nope'")
    # Triton's config override: this load uses the JSON config instead of the file's
    client.load_model("simple", config='{"max_batch_size": 4}')
    assert client.get_model_config("simple").config.max_batch_size == 4
    _assert_simple_ok(client)
    _fails(  # Triton answers a malformed override with INTERNAL
        lambda: client.load_model("simple", config='{"max_batch_size": "four"}'),
        "INTERNAL",
        "failed to load 'simple', failed to poll from model repository: load request "
        "parameter 'config': not a valid Triton model config",
    )
    _fails(
        lambda: client.load_model("simple", files={"file:1/model.onnx": b"x"}),
        "INVALID_ARGUMENT",
        "failed to load 'simple': load parameter 'config' must be provided",
    )


def test_inference_errors_keep_the_server_serving(stub: Any) -> None:
    raw, client = stub
    bad = _simple_inputs()
    _fails(
        lambda: client.infer("nope", bad), "INVALID_ARGUMENT", "unknown model: 'nope' is not found"
    )
    _assert_simple_ok(client)
    _fails(
        lambda: client.infer("simple", _simple_inputs(A, np.zeros((1, 15), np.int32))),
        "INVALID_ARGUMENT",
        "expected shape [-1, 16], got [1, 15]",
    )
    _assert_simple_ok(client)
    wrong = grpcclient.InferInput("INPUT1", [1, 16], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 16), np.float32))
    _fails(
        lambda: client.infer("simple", [bad[0], wrong]),
        "INVALID_ARGUMENT",
        "expected datatype INT32, got FP32",
    )
    _assert_simple_ok(client)
    _fails(
        lambda: client.infer("simple", bad, outputs=[grpcclient.InferRequestedOutput("X")]),
        "INVALID_ARGUMENT",
        "no output 'X'",
    )
    _assert_simple_ok(client)

    two = (("INPUT0", "INT32", [1, 16]), ("INPUT1", "INT32", [1, 16]))
    a_raw = A.tobytes()
    cases: list[tuple[Any, tuple[str, ...]]] = []
    one_raw = _raw_request(*two)
    one_raw.raw_input_contents.append(a_raw)
    cases.append((one_raw, ("1 raw_input_contents but 2 input(s)",)))
    three_raw = _raw_request(*two)
    three_raw.raw_input_contents.extend([a_raw] * 3)
    cases.append((three_raw, ("3 raw_input_contents but 2 input(s)",)))
    short = _raw_request(*two)
    short.raw_input_contents.extend([a_raw, a_raw[:-4]])
    cases.append(
        (
            short,
            (
                "input byte size mismatch for input 'INPUT1' for model 'simple'. "
                "Expected 64, got 60",
            ),
        )
    )
    # typed contents in a request that uses raw_input_contents: Triton's words (issue 21)
    triton_words = "contents field must not be specified when using raw_input_contents for "
    mixed = _raw_request(*two)
    mixed.inputs[1].contents.int_contents.extend(range(16))
    mixed.raw_input_contents.append(a_raw)
    cases.append((mixed, (triton_words + "'INPUT1' for model 'simple'",)))
    both = _raw_request(*two)  # INPUT0 sent twice over: typed contents and a raw entry
    both.inputs[0].contents.int_contents.extend(range(16))
    both.raw_input_contents.extend([a_raw, a_raw])
    cases.append((both, (triton_words + "'INPUT0' for model 'simple'",)))
    field = _raw_request(*two)
    field.inputs[0].contents.int_contents.extend(range(16))
    field.inputs[1].contents.fp32_contents.extend([1.0] * 16)
    cases.append((field, ("INT32 data belongs in contents.int_contents",)))
    count = _raw_request(*two)
    for tensor in count.inputs:
        tensor.contents.int_contents.extend(range(15))
    cases.append((count, ("contents.int_contents has 15 elements", "needs 16")))
    nodata = _raw_request(*two)
    cases.append((nodata, ("input 'INPUT0' has no data",)))
    dtype = _raw_request(("INPUT0", "INT33", [1, 16]))
    dtype.raw_input_contents.append(a_raw)
    cases.append((dtype, ("unsupported datatype 'INT33'",)))
    negative = _raw_request(("INPUT0", "INT32", [1, 16]), ("INPUT1", "INT32", [1, 16]))
    negative.raw_input_contents.extend([a_raw, a_raw])
    negative.parameters["timeout"].int64_param = -5
    cases.append((negative, ("'timeout' must be a non-negative integer",)))
    # declarations are checked against the model before any data is decoded (the
    # INT8 range check itself: tests/core/test_security_requests.py)
    int8 = _raw_request(("INPUT0", "INT8", [2]), model="simple")
    int8.inputs[0].contents.int_contents.extend([1, 300])
    cases.append((int8, ("expected datatype INT32, got INT8",)))
    for request, words in cases:
        _rpc_fails(lambda r=request: raw.ModelInfer(r), grpc.StatusCode.INVALID_ARGUMENT, *words)
        _assert_simple_ok(client)
    good = _raw_request(*two)
    for tensor in good.inputs:
        tensor.contents.int_contents.extend(range(16))
    reply = raw.ModelInfer(good)
    np.testing.assert_array_equal(np.frombuffer(reply.raw_output_contents[0], np.int32), A[0] * 2)


def test_a_name_that_is_not_utf8_is_invalid_argument(run_appliance: Any) -> None:
    """Triton answers a message protobuf cannot parse (here a model_name that is not
    UTF-8) with INVALID_ARGUMENT; grpcio's own deserialiser would answer UNKNOWN.
    On every RPC, the stream's requests included (an in-stream error there)."""
    srv = run_appliance()
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    not_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (model_name / name), 2 bytes, not UTF-8
    with grpc.insecure_channel(srv.grpc_url) as channel:
        for method in ("ModelInfer", "ModelMetadata", "ModelReady", "ModelConfig"):
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
            _rpc_fails(lambda c=call: c(not_utf8), grpc.StatusCode.INVALID_ARGUMENT, "UTF-8")
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        (reply,) = list(stream(iter([not_utf8])))
        assert "UTF-8" in reply.error_message
    _assert_simple_ok(client)


def test_oversized_message_is_resource_exhausted(run_appliance: Any) -> None:
    srv = run_appliance(max_request_size="64KiB")
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    big = grpcclient.InferInput("input", [1, 3, 224, 224], "FP32")  # 588 KiB
    big.set_data_from_numpy(np.zeros((1, 3, 224, 224), np.float32))
    _fails(lambda: client.infer("classifier", [big]), "RESOURCE_EXHAUSTED")
    _assert_simple_ok(client)


@pytest.fixture
def regions() -> Iterator[Callable[[str, int], Any]]:
    """Factory for POSIX shared-memory regions (tritonclient's helper); destroyed after."""
    made: list[Any] = []

    def make(name: str, byte_size: int) -> Any:
        handle = shm.create_shared_memory_region(name, f"/{name}_{os.getpid()}", byte_size)
        made.append(handle)
        return handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def test_shared_memory_inputs_and_outputs(run_appliance: Any, regions: Any) -> None:
    srv = run_appliance(shared_memory="system")
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    assert "system_shared_memory" in client.get_server_metadata().extensions
    inp, out = regions("grpc_in", 128), regions("grpc_out", 128)
    shm.set_shared_memory_region(inp, [A, B])  # INPUT0 at 0, INPUT1 at 64
    client.register_system_shared_memory("grpc_in", f"/grpc_in_{os.getpid()}", 128)
    client.register_system_shared_memory("grpc_out", f"/grpc_out_{os.getpid()}", 128)
    status = client.get_system_shared_memory_status().regions
    assert {n: r.byte_size for n, r in status.items()} == {"grpc_in": 128, "grpc_out": 128}

    def request(in_offset: int = 64, region: str = "grpc_in") -> list[grpcclient.InferInput]:
        inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory("grpc_in", 64)
        inputs[1].set_shared_memory(region, 64, offset=in_offset)
        return inputs

    outputs = [grpcclient.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
    outputs[0].set_shared_memory("grpc_out", 64)
    outputs[1].set_shared_memory("grpc_out", 64, offset=64)
    result = client.infer("simple", request(), outputs=outputs)
    # as Triton: one empty raw entry per output written to the region, no parameters
    assert list(result.get_response().raw_output_contents) == [b"", b""]
    assert not result.get_output("OUTPUT1").parameters
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.int32, [1, 16]), A + B)
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(out, np.int32, [1, 16], offset=64), A - B
    )
    # one output in shared memory, one inline: tritonclient finds the inline one by position
    shm.set_shared_memory_region(out, [np.zeros((2, 16), np.int32)])
    mixed = client.infer(
        "simple", request(), outputs=[outputs[0], grpcclient.InferRequestedOutput("OUTPUT1")]
    )
    np.testing.assert_array_equal(mixed.as_numpy("OUTPUT1"), A - B)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.int32, [1, 16]), A + B)

    _fails(
        lambda: client.infer("simple", request(region="nope")),
        "INVALID_ARGUMENT",
        "Unable to find shared memory region: 'nope'",
    )
    _fails(
        lambda: client.infer("simple", request(in_offset=100)),
        "INVALID_ARGUMENT",
        "Invalid offset + byte size for shared memory region: 'grpc_in'",
    )
    small = grpcclient.InferRequestedOutput("OUTPUT0")
    small.set_shared_memory("grpc_out", 32)
    _fails(
        lambda: client.infer("simple", request(), outputs=[small]),
        "INVALID_ARGUMENT",
        "needs 64 bytes but shared_memory_byte_size is 32",
    )
    with grpc.insecure_channel(srv.grpc_url) as channel:
        message = _raw_request(("INPUT0", "INT32", [1, 16]), ("INPUT1", "INT32", [1, 16]))
        message.raw_input_contents.extend([A.tobytes(), B.tobytes()])
        top = message.outputs.add(name="OUTPUT0")
        top.parameters["classification"].int64_param = 2
        top.parameters["shared_memory_region"].string_param = "grpc_out"
        top.parameters["shared_memory_byte_size"].int64_param = 64
        infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        _rpc_fails(lambda: infer(message), grpc.StatusCode.INVALID_ARGUMENT, "classification")
        top.parameters["shared_memory_byte_size"].string_param = "64"
        del top.parameters["classification"]
        _rpc_fails(
            lambda: infer(message),
            grpc.StatusCode.INVALID_ARGUMENT,
            "'shared_memory_byte_size' must be set as int64_param, got string_param",
        )
    _assert_simple_ok(client)
    client.unregister_system_shared_memory("grpc_in")
    assert list(client.get_system_shared_memory_status().regions) == ["grpc_out"]
    _fails(
        lambda: client.infer("simple", request()),
        "INVALID_ARGUMENT",
        "Unable to find shared memory region",
    )
    client.unregister_system_shared_memory()
    assert not client.get_system_shared_memory_status().regions


def test_shared_memory_is_off_by_default(run_appliance: Any, regions: Any) -> None:
    srv = run_appliance()
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    regions("grpc_off", 64)
    _fails(
        lambda: client.register_system_shared_memory("r", f"/grpc_off_{os.getpid()}", 64),
        "INVALID_ARGUMENT",
        "system shared memory is disabled",
    )
    inputs = _simple_inputs()
    inputs[1].set_shared_memory("r", 64)
    _fails(lambda: client.infer("simple", inputs), "INVALID_ARGUMENT", "disabled")
    # CUDA shared memory: answered as a Triton without GPU support answers
    assert not client.get_cuda_shared_memory_status().regions
    client.unregister_cuda_shared_memory()
    _fails(
        lambda: client.register_cuda_shared_memory("c", b"", 0, 64),
        "INVALID_ARGUMENT",
        "not supported on this device",
    )
    _assert_simple_ok(client)


def test_the_wire_encoder_writes_what_protobuf_writes() -> None:
    """grpc_wire writes ModelInferResponse bytes by hand: the same bytes protobuf writes
    for the message grpc_codec builds, and they parse back to it."""
    from appliance.adapters.grpc import codec
    from appliance.adapters.grpc import wire as grpc_wire
    from appliance.core.shared_memory import SharedMemoryRegistry
    from appliance.request import InferenceResponse

    outputs = {
        "OUTPUT0": np.arange(16, dtype=np.int32).reshape(1, 16),
        "scalar": np.float64(2.5).reshape(()),
        "text": np.array([b"a", b"\xff\x00"], dtype=object),
        "empty": np.zeros((0, 3), np.float32),
        "big": np.ones((3, 300, 200), np.float32),
        "edges": np.zeros((127, 128, 1), np.uint8),  # a dim past one varint byte
        "wide": np.ones((1, 2), ">i4"),  # big-endian: written little-endian
    }
    shm = SharedMemoryRegistry(enabled=False)
    # every response twice: its fixed fields are encoded once and kept
    cases = [("simple", "1", ""), ("simple", "1", "req-7"), ("mod\u00e8le", "", ""),
             ("mod\u00e8le", "12", "x" * 200)]  # fmt: skip
    for name, version, rid in cases * 2:
        response = InferenceResponse(name, version, outputs, rid)
        wire = grpc_wire.encode_response(response, {}, shm)
        expected = codec.encode_response(response, {}, shm)
        assert wire == expected.SerializeToString()
        assert service_pb2.ModelInferResponse.FromString(wire) == expected
        framed = grpc_wire.encode_response(response, {}, shm, framed=True)
        assert framed == b"\x00" + len(wire).to_bytes(4, "big") + wire


def test_raw_contents_are_views_of_the_wire() -> None:
    from appliance.adapters.grpc import wire as grpc_wire

    request = _raw_request(("INPUT0", "INT32", [1, 16]), ("INPUT1", "INT32", [1, 16]))
    request.id = "x" * 300  # a length past one varint byte
    request.parameters["sequence_id"].int64_param = 2**40
    request.raw_input_contents.extend([A.tobytes(), b"", bytes(range(256)) * 600])
    wire = request.SerializeToString()
    views = grpc_wire.raw_contents(wire)
    assert [bytes(v) for v in views] == list(request.raw_input_contents)
    assert all(v.obj is wire for v in views)  # no copy
