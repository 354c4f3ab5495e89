"""Cases of Triton's own server QA suite (``qa/L0_*``) written as our own tests: each
names the Triton test it follows, and asserts what real Triton 2.51 answers."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from appliance.config.fields import ConfigError
from appliance.config.server_config import load_server_config
from devtools import modelgen


def _unknown_rank_identity(name: str) -> bytes:
    """Triton's ``gen_qa_ort_scalar_models``: an ONNX identity with no shape at all."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT"], ["OUTPUT"])],
        name,
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def test_scalar_io_models_with_config_dims_of_ones_serve(run_appliance, tmp_path: Path) -> None:
    # L0_scalar_io: ONNX Runtime reports shape [] for these; the config says [1], [1, 1]
    for name, dims in (("onnx_scalar_1dim", "1"), ("onnx_scalar_2dim", "1, 1")):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.onnx").write_bytes(_unknown_rank_identity(name))
        (tmp_path / name / "config.pbtxt").write_text(
            f'input [{{ name: "INPUT" data_type: TYPE_FP32 dims: [ {dims} ] }}]\n'
            f'output [{{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ {dims} ] }}]\n'
        )
    srv = run_appliance(tmp_path)
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    for name, value in (
        ("onnx_scalar_1dim", np.asarray([1], np.float32)),
        ("onnx_scalar_2dim", np.asarray([[1]], np.float32)),
    ):
        tensor = grpcclient.InferInput("INPUT", list(value.shape), "FP32")
        tensor.set_data_from_numpy(value)
        got = client.infer(name, [tensor]).as_numpy("OUTPUT")
        np.testing.assert_allclose(got, value)


def _post(
    url: str, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, str], bytes]:
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


RAW = {"Inference-Header-Content-Length": "0"}


def _raw_models(repo: Path) -> Path:
    """L0_http's models for raw binary requests (Triton's ``onnx_zero_*``)."""
    modelgen.write_model(
        repo,
        "onnx_zero_1_float32",
        modelgen.identity("FP32", [-1]),
        ZERO_1.format(t="TYPE_FP32", dims="[-1]"),
    )
    modelgen.write_model(
        repo,
        "onnx_zero_1_float16",
        modelgen.identity("FP16", [-1, -1]),
        ZERO_1.format(t="TYPE_FP16", dims="[-1, -1]"),
    )
    modelgen.write_model(
        repo,
        "onnx_zero_1_object_1_element",
        modelgen.identity("BYTES", [1]),
        ZERO_1.format(t="TYPE_STRING", dims="[1]"),
    )
    modelgen.write_model(
        repo,
        "onnx_zero_1_object",
        modelgen.identity("BYTES", [-1]),
        ZERO_1.format(t="TYPE_STRING", dims="[-1]"),
    )
    modelgen.write_model(
        repo, "onnx_zero_3_float32", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG
    )
    return repo


ZERO_1 = """\
backend: onnxruntime
max_batch_size: 8
input: [{{name: INPUT0, data_type: {t}, dims: {dims}}}]
output: [{{name: OUTPUT0, data_type: {t}, dims: {dims}}}]
"""


def test_raw_binary_requests_answer_as_triton(run_appliance, tmp_path: Path) -> None:
    # L0_http test_raw_binary, test_raw_binary_longer, test_byte and the refusals
    srv = run_appliance(_raw_models(tmp_path))
    for count in (8, 32, 0):
        data = np.arange(count, dtype=np.float32).tobytes()
        status, headers, body = _post(srv.url, "/v2/models/onnx_zero_1_float32/infer", data, RAW)
        assert status == 200, body
        header = int(headers["Inference-Header-Content-Length"])
        assert body[header:] == data
        (output,) = json.loads(body[:header])["outputs"]
        assert output["shape"] == [1, count]
    status, headers, body = _post(
        srv.url, "/v2/models/onnx_zero_1_object_1_element/infer", b"427", RAW
    )
    assert status == 200, body
    assert body[int(headers["Inference-Header-Content-Length"]) + 4 :] == b"427"
    for model, data, text in (
        (
            "onnx_zero_1_object",
            b"427",
            "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]",
        ),
        (
            "onnx_zero_1_float16",
            np.ones([2, 2], np.float16).tobytes(),
            "The shape of the raw input 'INPUT0' can not be deduced because there are more "
            "than one variable-sized dimension",
        ),
        (
            "onnx_zero_3_float32",
            np.arange(24, dtype=np.float32).tobytes(),
            "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in "
            "'onnx_zero_3_float32' model configuration",
        ),
    ):
        status, _, body = _post(srv.url, f"/v2/models/{model}/infer", data, RAW)
        assert status == 400
        assert text in body.decode()


def _exchange(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request written as given, its answer read to the end."""
    host, port = url.split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(request)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, dict(resp.getheaders()), resp.read()


def test_a_chunked_request_body_is_served(run_appliance, tmp_path: Path) -> None:
    # L0_http test_content_encoding_chunked_manually: a raw binary body in chunks
    srv = run_appliance(_raw_models(tmp_path))
    data = np.arange(8, dtype=np.float32).tobytes()
    head = (
        b"POST /v2/models/onnx_zero_1_float32/infer HTTP/1.1\r\nHost: x\r\n"
        b"Inference-Header-Content-Length: 0\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n"
    )
    chunks = b"%X\r\n%s\r\n%X\r\n%s\r\n0\r\n\r\n" % (10, data[:10], 22, data[10:])
    status, headers, body = _exchange(srv.url, head + chunks)
    assert status == 200, body
    assert body[int(headers["Inference-Header-Content-Length"]) :] == data


def test_chunked_bodies_meet_the_token_and_the_size_limit(run_appliance, tmp_path: Path) -> None:
    srv = run_appliance(_raw_models(tmp_path), inference_token="s3cret", max_request_size="64KiB")
    path = b"POST /v2/models/onnx_zero_1_float32/infer HTTP/1.1\r\nHost: x\r\n"
    chunked = b"Inference-Header-Content-Length: 0\r\nTransfer-Encoding: chunked\r\n"
    big = b"%X\r\n%s\r\n" % (65536, bytes(65536))
    # no token: refused before the body is read
    status, _, _ = _exchange(srv.url, path + chunked + b"\r\n" + big + b"0\r\n\r\n")
    assert status == 401
    auth = b"Authorization: Bearer s3cret\r\n"
    # over max_request_size: 413, however the body is cut
    status, _, body = _exchange(srv.url, path + auth + chunked + b"\r\n" + big * 2 + b"0\r\n\r\n")
    assert status == 413, body
    data = np.arange(4, dtype=np.float32).tobytes()
    ok = path + auth + chunked + b"Connection: close\r\n\r\n" + b"10\r\n%s\r\n0\r\n\r\n" % data
    status, _, body = _exchange(srv.url, ok)
    assert status == 200, body


def test_a_batch_that_cannot_grow_runs_without_waiting_out_the_delay(
    run_appliance, tmp_path: Path
) -> None:
    # L0_batcher test_multi_batch_different_shape: a request of another shape ends the
    # batch ahead of it, which runs at once; the other waits out the delay (an hour
    # here: a batch held for it would never be answered in this test)
    config = ZERO_1.format(t="TYPE_FP32", dims="[-1]") + (
        "dynamic_batching: {max_queue_delay_microseconds: 3600000000}\n"
    )
    modelgen.write_model(tmp_path, "m", modelgen.identity("FP32", [-1]), config)
    srv = run_appliance(tmp_path, drain_timeout_s=1)

    def ask(cols: int) -> list[list[float]]:
        client = httpclient.InferenceServerClient(srv.url, network_timeout=600)
        tensor = httpclient.InferInput("INPUT0", [1, cols], "FP32")
        tensor.set_data_from_numpy(np.full((1, cols), cols, np.float32))
        return client.infer("m", [tensor]).as_numpy("OUTPUT0").tolist()

    pool = concurrent.futures.ThreadPoolExecutor(2)
    calls = {pool.submit(ask, cols): cols for cols in (2, 3)}
    # a liveness bound, not a timing margin: the batch ahead is never held for an hour
    done, waiting = concurrent.futures.wait(
        calls, timeout=300, return_when=concurrent.futures.FIRST_COMPLETED
    )
    assert len(done) == 1 and len(waiting) == 1  # the other waits out its delay
    (call,) = done
    cols = calls[call]
    assert call.result() == [[float(cols)] * cols]
    pool.shutdown(wait=False)  # the server's stop at teardown fails the one waiting


ONE_OUT_PY = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = pb_utils.Tensor("OUTPUT0", np.array([1], dtype=np.float32))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
"""


def _inputs_model(repo: Path, name: str, optional: tuple[bool, ...]) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(ONE_OUT_PY)
    inputs = ",\n".join(
        f'  {{ name: "INPUT{i}" data_type: TYPE_FP32 dims: [ -1 ] optional: {str(o).lower()} }}'
        for i, o in enumerate(optional)
    )
    (repo / name / "config.pbtxt").write_text(
        f'backend: "python"\ninput [\n{inputs}\n]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        "instance_group [{ kind: KIND_CPU }]\n"
    )


def test_input_counts_answer_as_triton(run_appliance, tmp_path: Path) -> None:
    # L0_input_validation InputValTest, over gRPC as Triton's test sends them
    _inputs_model(tmp_path, "input_all_optional", (True, True, True))
    _inputs_model(tmp_path, "input_all_required", (False, False, False))
    _inputs_model(tmp_path, "input_optional", (False, False, False, True))
    srv = run_appliance(tmp_path)
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    result = client.infer("input_all_optional", [])
    assert result.get_response().outputs[0].name == "OUTPUT0"
    http = httpclient.InferenceServerClient(srv.url)
    assert http.infer("input_all_optional", []).as_numpy("OUTPUT0").tolist() == [1.0]

    one = grpcclient.InferInput("INPUT0", [1], "FP32")
    one.set_data_from_numpy(np.arange(1, dtype=np.float32))
    for model, inputs, text in (
        (
            "input_all_required",
            [],
            "expected 3 inputs but got 0 inputs for model 'input_all_required'. Got input(s) "
            "[], but missing required input(s) ['INPUT0','INPUT1','INPUT2']. Please provide "
            "all required input(s).",
        ),
        (
            "input_optional",
            [],
            "expected number of inputs between 3 and 4 but got 0 inputs for model "
            "'input_optional'. Got input(s) [], but missing required input(s) "
            "['INPUT0','INPUT1','INPUT2']. Please provide all required input(s).",
        ),
        (
            "input_all_required",
            [one],
            "expected 3 inputs but got 1 inputs for model 'input_all_required'. Got input(s) "
            "['INPUT0'], but missing required input(s) ['INPUT1','INPUT2']. Please provide "
            "all required input(s).",
        ),
        (
            "input_optional",
            [one],
            "expected number of inputs between 3 and 4 but got 1 inputs for model "
            "'input_optional'. Got input(s) ['INPUT0'], but missing required input(s) "
            "['INPUT1','INPUT2']. Please provide all required input(s).",
        ),
    ):
        with pytest.raises(InferenceServerException) as refused:
            client.infer(model, inputs)
        assert text in str(refused.value)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"


GATE_PY = """\
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.folder = os.environ["QA_GATE_DIR"]

    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if x.any():  # the test's request, not the warm-up's zeros: wait at the gate
                open(os.path.join(self.folder, "started"), "w").close()
                for _ in range(6000):  # until the test opens it (at most ten minutes)
                    if os.path.exists(os.path.join(self.folder, "open")):
                        break
                    time.sleep(0.1)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * 2)]))
        return out
"""


def _wait_for(path: Path) -> None:
    for _ in range(6000):  # bounded: ten minutes
        if path.exists():
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} never appeared")


def test_unregistering_a_region_in_use_lets_its_inference_finish(
    run_appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # L0_shared_memory TestSharedMemoryUnregister (HTTP and gRPC)
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("QA_GATE_DIR", str(gate))
    repo = tmp_path / "repo"
    (repo / "gate" / "1").mkdir(parents=True)
    (repo / "gate" / "1" / "model.py").write_text(GATE_PY)
    (repo / "gate" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
    )
    srv = run_appliance(repo, shared_memory="system")
    admin = httpclient.InferenceServerClient(srv.url)
    key_in, key_out = f"/qa_in_{os.getpid()}", f"/qa_out_{os.getpid()}"
    handles = [
        shm.create_shared_memory_region(n, k, 64) for n, k in (("i", key_in), ("o", key_out))
    ]
    try:
        shm.set_shared_memory_region(handles[0], [np.arange(1, 17, dtype=np.int32)])
        for client_kind in ("http", "grpc"):
            (gate / "open").unlink(missing_ok=True)
            (gate / "started").unlink(missing_ok=True)
            admin.register_system_shared_memory("in", key_in, 64)
            admin.register_system_shared_memory("out", key_out, 64)
            module = httpclient if client_kind == "http" else grpcclient
            url = srv.url if client_kind == "http" else srv.grpc_url
            client = module.InferenceServerClient(url)
            tensor = module.InferInput("INPUT0", [16], "INT32")
            tensor.set_shared_memory("in", 64)
            output = module.InferRequestedOutput("OUTPUT0")
            output.set_shared_memory("out", 64)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                call = pool.submit(client.infer, "gate", [tensor], outputs=[output])
                _wait_for(gate / "started")
                admin.unregister_system_shared_memory()  # no error, as in Triton
                # still listed: the inference in flight uses them
                assert sorted(r["name"] for r in admin.get_system_shared_memory_status()) == [
                    "in",
                    "out",
                ]
                (gate / "open").touch()
                call.result()
            got = shm.get_contents_as_numpy(handles[1], np.int32, [16])
            assert got.tolist() == (2 * np.arange(1, 17)).tolist()
            assert admin.get_system_shared_memory_status() == []  # gone with the request
    finally:
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


STRING_IDENTITY_PY = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return out
"""


def test_bytes_that_are_not_utf8_round_trip_in_binary_and_refuse_json(
    run_appliance, tmp_path: Path
) -> None:
    # L0_string_io test_unicode_bytes: binary outputs and gRPC carry any bytes; a JSON
    # output cannot, and is an error instead of a silent replacement
    (tmp_path / "string_identity" / "1").mkdir(parents=True)
    (tmp_path / "string_identity" / "1" / "model.py").write_text(STRING_IDENTITY_PY)
    (tmp_path / "string_identity" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
    )
    srv = run_appliance(tmp_path)
    data = np.array([b"\xfa\x03\x94ok", "€".encode(), b"plain"], dtype=object)
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", [3], "BYTES")
    tensor.set_data_from_numpy(data)
    assert grpc.infer("string_identity", [tensor]).as_numpy("OUTPUT0").tolist() == data.tolist()
    http = httpclient.InferenceServerClient(srv.url)
    tensor = httpclient.InferInput("INPUT0", [3], "BYTES")
    tensor.set_data_from_numpy(data, binary_data=True)
    binary = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    got = http.infer("string_identity", [tensor], outputs=[binary]).as_numpy("OUTPUT0")
    assert got.tolist() == data.tolist()
    as_json = httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)
    with pytest.raises(InferenceServerException) as refused:
        http.infer("string_identity", [tensor], outputs=[as_json])
    assert refused.value.status() == "400"
    assert "output 'OUTPUT0': a BYTES element is not UTF-8" in str(refused.value)
    # UTF-8 elements travel as JSON strings
    tensor = httpclient.InferInput("INPUT0", [2], "BYTES")
    tensor.set_data_from_numpy(data[1:], binary_data=True)
    got = http.infer("string_identity", [tensor], outputs=[as_json]).as_numpy("OUTPUT0")
    assert [x if isinstance(x, bytes) else x.encode() for x in got.tolist()] == data[1:].tolist()
    # two requests for one output: Triton's text
    with pytest.raises(InferenceServerException) as twice:
        http.infer("string_identity", [tensor], outputs=[binary, binary])
    assert "output 'OUTPUT0' already exists in request" in str(twice.value)
    with pytest.raises(InferenceServerException) as twice:
        grpc.infer(
            "string_identity",
            [grpcclient.InferInput("INPUT0", [1], "BYTES").set_data_from_numpy(data[2:])],
            outputs=[grpcclient.InferRequestedOutput("OUTPUT0")] * 2,
        )
    assert "output 'OUTPUT0' already exists in request" in str(twice.value)


def test_trace_settings_given_at_start_are_reported_back(run_appliance, tmp_path: Path) -> None:
    # L0_trace: the server starts with --trace-config level=TIMESTAMPS rate=1
    srv = run_appliance(
        trace_file=str(tmp_path / "trace.json"),
        trace_settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"},
    )
    http = httpclient.InferenceServerClient(srv.url)
    settings = http.get_trace_settings()
    assert settings["trace_level"] == ["TIMESTAMPS"] and settings["trace_rate"] == "1"
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    reply = grpc.get_trace_settings(as_json=True)["settings"]
    assert reply["trace_level"]["value"] == ["TIMESTAMPS"]
    assert reply["trace_rate"]["value"] == ["1"]


def test_trace_settings_in_the_server_config_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"trace_settings: unknown setting 'trace_speed'"):
        load_server_config(None, {"trace_settings": {"trace_speed": "1"}})
    with pytest.raises(ConfigError, match=r"trace_settings.trace_rate: expected a string"):
        load_server_config(None, {"trace_settings": {"trace_rate": {"a": 1}}})


KIND_PY = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.kind = args["model_instance_kind"]

    def execute(self, requests):
        out = pb_utils.Tensor("KIND", np.array([self.kind.encode()], dtype=object))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
"""


def test_instance_groups_of_kind_model_load(run_appliance, tmp_path: Path) -> None:
    # Triton's mock_llm: the model places itself (instance_group kind KIND_MODEL)
    (tmp_path / "placed" / "1").mkdir(parents=True)
    (tmp_path / "placed" / "1" / "model.py").write_text(KIND_PY)
    (tmp_path / "placed" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] optional: true } ]\n'
        'output [ { name: "KIND" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        "instance_group [ { kind: KIND_MODEL } ]\n"
    )
    srv = run_appliance(tmp_path)
    http = httpclient.InferenceServerClient(srv.url)
    assert http.infer("placed", []).as_numpy("KIND").tolist() == [b"MODEL"]
    assert http.get_model_config("placed")["instance_group"][0]["kind"] == "KIND_MODEL"


ORDER_PY = """\
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.folder = os.environ["QA_GATE_DIR"]

    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if x.any():
                with open(os.path.join(self.folder, "order"), "a") as f:
                    f.write(f"{int(x.ravel()[0])}\\n")
            if int(x.ravel()[0]) == 100:  # the first request waits at the gate
                open(os.path.join(self.folder, "started"), "w").close()
                for _ in range(6000):
                    if os.path.exists(os.path.join(self.folder, "open")):
                        break
                    time.sleep(0.1)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return out
"""


def test_priority_levels_reorder_the_queue_over_http_and_grpc(
    run_appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("QA_GATE_DIR", str(gate))
    repo = tmp_path / "repo"
    (repo / "ordered" / "1").mkdir(parents=True)
    (repo / "ordered" / "1" / "model.py").write_text(ORDER_PY)
    (repo / "ordered" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 1\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        "dynamic_batching { priority_levels: 2 default_priority_level: 2 }\n"
    )
    srv = run_appliance(repo)
    http = httpclient.InferenceServerClient(srv.url)
    assert http.get_model_config("ordered")["dynamic_batching"]["priority_levels"] == 2

    def ask(value: int, priority: int, kind: str = "http") -> None:
        module = httpclient if kind == "http" else grpcclient
        client = module.InferenceServerClient(srv.url if kind == "http" else srv.grpc_url)
        tensor = module.InferInput("INPUT0", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[value]], np.int32))
        client.infer("ordered", [tensor], priority=priority)

    def queued() -> int:  # requests waiting in the model's queue (read, not written)
        return int(srv.server.lifecycle.get("ordered").stats.pending)

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        calls = [pool.submit(ask, 100, 0)]
        _wait_for(gate / "started")
        for value, priority, kind in (
            (1, 2, "http"),
            (2, 0, "grpc"),
            (3, 1, "grpc"),
            (4, 1, "http"),
        ):
            calls.append(pool.submit(ask, value, priority, kind))
            for _ in range(6000):  # until it is queued (bounded: ten minutes)
                if queued() == len(calls) - 1:
                    break
                time.sleep(0.1)
        (gate / "open").touch()
        for call in calls:
            call.result()
    # the urgent (1) first, in arrival order; then the default level (0 and 2)
    assert (gate / "order").read_text().split() == ["100", "3", "4", "1", "2"]


def test_a_client_that_goes_away_frees_its_queued_request(
    run_appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("QA_GATE_DIR", str(gate))
    repo = tmp_path / "repo"
    (repo / "ordered" / "1").mkdir(parents=True)
    (repo / "ordered" / "1" / "model.py").write_text(ORDER_PY)
    (repo / "ordered" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 1\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        "dynamic_batching { }\n"
    )
    srv = run_appliance(repo)
    stats = srv.server.lifecycle.get("ordered").stats

    def until(done: Callable[[], bool]) -> None:
        for _ in range(6000):  # bounded: ten minutes
            if done():
                return
            time.sleep(0.1)
        raise AssertionError("never happened")

    def body(value: int) -> bytes:
        doc = {
            "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 1], "data": [value]}]
        }
        data = json.dumps(doc).encode()
        return (
            b"POST /v2/models/ordered/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
        )

    host, port = srv.url.split(":")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(_exchange, srv.url, body(100))
        _wait_for(gate / "started")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(body(7))
            until(lambda: stats.pending == 1)
            # gone for good: a reset (a FIN alone is a half-close, which still gets
            # its answer)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        until(lambda: stats.pending == 0)  # the client left: its request left the queue
        (gate / "open").touch()
        assert held.result()[0] == 200
    http = httpclient.InferenceServerClient(srv.url)
    tensor = httpclient.InferInput("INPUT0", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[9]], np.int32))
    http.infer("ordered", [tensor])
    assert (gate / "order").read_text().split() == ["100", "9"]  # 7 never ran


AUTO_PY = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        have = {t["name"] for t in config.as_dict()["input"]}
        if "INPUT0" not in have:
            config.add_input({"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [1]})
        config.add_output({"name": "key", "data_type": "TYPE_STRING", "dims": [-1]})
        config.set_max_batch_size(0)
        return config

    def execute(self, requests):
        out = pb_utils.Tensor("key", np.array([b"done"], dtype=object))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
"""


def test_a_python_model_without_a_config_completes_its_own(run_appliance, tmp_path: Path) -> None:
    # L0_parameters' parameter model: no config.pbtxt, auto_complete_config declares all
    (tmp_path / "parameter" / "1").mkdir(parents=True)
    (tmp_path / "parameter" / "1" / "model.py").write_text(AUTO_PY)
    srv = run_appliance(tmp_path)
    http = httpclient.InferenceServerClient(srv.url)
    config = http.get_model_config("parameter")
    assert config["max_batch_size"] == 0
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("INPUT0", "TYPE_FP32", [1])
    ]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [
        ("key", "TYPE_STRING", [-1])
    ]
    tensor = httpclient.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(np.ones(1, np.float32))
    assert http.infer("parameter", [tensor]).as_numpy("key").tolist() == [b"done"]


def test_a_chunked_body_sent_with_a_content_length_too_is_framed_by_its_chunks(
    run_appliance, tmp_path: Path
) -> None:
    # L0_http test_content_encoding_chunked_manually: `requests` adds a Content-Length
    # to the chunked body; served by the chunks (RFC 9112), and the connection closes
    srv = run_appliance(_raw_models(tmp_path))
    data = np.arange(8, dtype=np.float32).tobytes()
    chunks = b"%X\r\n%s\r\n0\r\n\r\n" % (len(data), data)
    head = (
        b"POST /v2/models/onnx_zero_1_float32/infer HTTP/1.1\r\nHost: x\r\n"
        b"Inference-Header-Content-Length: 0\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: %d\r\n\r\n" % len(chunks)
    )
    host, port = srv.url.split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + chunks)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        body = resp.read()
        assert resp.status == 200, body
        assert body[int(resp.getheader("Inference-Header-Content-Length")) :] == data
        assert resp.getheader("Connection") == "close"
        assert sock.recv(1) == b""  # closed: nothing can follow on this connection
