"""Triton's Python backend API over a real server on 127.0.0.1: a request's
``parameters()`` (L0_parameters' ``parameter`` model), the response sender of a regular
model, and cancellation reaching a running model (L0_request_cancellation's
``execute_cancel`` and ``response_sender_until_cancelled``), in the server process and
in a worker process. The models are our own equivalents of Triton's."""

from __future__ import annotations

import json
import queue
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from appliance.config.fields import ConfigError
from appliance.config.server_config import load_server_config
from tests.test_triton_qa_cases import _exchange, _post

PARAMETER_PY = """\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            parameters = json.loads(request.parameters())
            keys = np.asarray(list(parameters), dtype=object)
            values = np.asarray(list(parameters.values()), dtype=object)
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("key", keys), pb_utils.Tensor("value", values)]
                )
            )
        return responses
"""

IDENTITY_PY = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value)]))
        return out
"""

SENDER_PY = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            sender = request.get_response_sender()
            sender.send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value * 2)]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        return None
"""

_IO = (
    'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
)
_PARAMETER_CONFIG = (
    'backend: "python"\nmax_batch_size: 0\n'
    'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    'output [ { name: "key" data_type: TYPE_STRING dims: [ -1 ] },\n'
    '         { name: "value" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
)
_ENSEMBLE_CONFIG = """\
platform: "ensemble"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "key" data_type: TYPE_STRING dims: [ -1 ] },
         { name: "value" data_type: TYPE_STRING dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "identity" model_version: -1
    input_map { key: "INPUT0" value: "INPUT0" } output_map { key: "OUTPUT0" value: "OUTPUT0" } },
  { model_name: "parameter" model_version: -1
    input_map { key: "INPUT0" value: "OUTPUT0" }
    output_map { key: "key" value: "key" } output_map { key: "value" value: "value" } }
] }
"""
_PROCESS = 'parameters { key: "execution" value: { string_value: "process" } }\n'


def _model(repo: Path, name: str, code: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(code)
    (repo / name / "config.pbtxt").write_text(config)


def _parameter_repo(repo: Path) -> Path:
    """L0_parameters' repository: ``parameter``, ``identity`` and ``ensemble`` of the
    two; ``parameter_process`` is ``parameter`` in a worker process."""
    _model(repo, "parameter", PARAMETER_PY, _PARAMETER_CONFIG)
    _model(repo, "parameter_process", PARAMETER_PY, _PARAMETER_CONFIG + _PROCESS)
    _model(repo, "identity", IDENTITY_PY, 'backend: "python"\nmax_batch_size: 0\n' + _IO)
    (repo / "ensemble" / "1").mkdir(parents=True)
    (repo / "ensemble" / "config.pbtxt").write_text(_ENSEMBLE_CONFIG)
    return repo


def _check(result: object, parameters: dict[str, object]) -> None:
    # L0_parameters' verify_outputs: the keys, and the values as str() of what was sent
    keys = result.as_numpy("key")  # type: ignore[attr-defined]
    values = result.as_numpy("value")  # type: ignore[attr-defined]
    assert set(keys.astype(str).tolist()) == set(parameters)
    assert set(values.astype(str).tolist()) == {str(v) for v in parameters.values()}


def test_a_python_model_reads_the_requests_parameters_as_triton(
    run_appliance, tmp_path: Path
) -> None:
    # L0_parameters test_params: HTTP, gRPC, the gRPC stream and through an ensemble
    srv = run_appliance(_parameter_repo(tmp_path))
    http = httpclient.InferenceServerClient(srv.url)
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    value = np.asarray([1], np.float32)
    answers: queue.Queue[object] = queue.Queue()
    for parameters in (
        {"key1": "value1", "key2": "value2"},
        {"key1": 1, "key2": 2},
        {"key1": 123.123, "key2": 321.321},
        {"key1": True, "key2": "value2"},
    ):
        for client, module in ((http, httpclient), (grpc, grpcclient)):
            tensor = module.InferInput("INPUT0", [1], "FP32")
            tensor.set_data_from_numpy(value)
            for model in ("parameter", "parameter_process", "ensemble"):
                _check(client.infer(model, [tensor], parameters=parameters), parameters)
        grpc.start_stream(callback=lambda result, error: answers.put(error or result))
        tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
        tensor.set_data_from_numpy(value)
        grpc.async_stream_infer("parameter", [tensor], parameters=parameters)
        _check(answers.get(timeout=60), parameters)
        grpc.stop_stream()


def test_the_servers_own_parameters_are_not_the_models(run_appliance, tmp_path: Path) -> None:
    # Triton's frontends take priority, timeout and binary_data_output for themselves
    srv = run_appliance(_parameter_repo(tmp_path))
    body = {
        "inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1.0]}],
        "parameters": {"priority": 0, "timeout": 10_000_000, "mine": "yes"},
    }
    status, _, answer = _post(srv.url, "/v2/models/parameter/infer", json.dumps(body).encode(), {})
    assert status == 200, answer
    outputs = {o["name"]: o["data"] for o in json.loads(answer)["outputs"]}
    assert outputs == {"key": ["mine"], "value": ["yes"]}


def test_reserved_and_malformed_parameters_are_refused_as_triton(
    run_appliance, tmp_path: Path
) -> None:
    # L0_parameters test_params_reserved_rejected (the raw HTTP half) and Triton's
    # texts for a triton_ key over gRPC and a value of no parameter type
    srv = run_appliance(_parameter_repo(tmp_path))

    def post(parameters: dict[str, object]) -> tuple[int, bytes]:
        body = {
            "inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1.0]}],
            "parameters": parameters,
        }
        status, _, answer = _post(
            srv.url, "/v2/models/parameter/infer", json.dumps(body).encode(), {}
        )
        return status, answer

    for key in (
        "triton_enable_empty_final_response",
        "triton_final_response",
        "triton_injected_via_header",
    ):
        status, answer = post({key: "dummy-value"})
        assert status == 400 and b"reserved for Triton usage" in answer
    status, answer = post({"mine": [1, 2]})
    assert status == 400 and b"parameter 'mine' has invalid type" in answer
    # tritonclient refuses triton_ keys itself: the message is made by hand
    message = service_pb2.ModelInferRequest(model_name="parameter")
    tensor = message.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
    tensor.contents.fp32_contents.append(1.0)
    with grpc.insecure_channel(srv.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for key, value, text in (
            ("triton_mine", "string_param", "reserved for Triton usage"),
            ("mine", "uint64_param", "invalid value type for 'mine' parameter"),
        ):
            message.parameters.clear()
            setattr(message.parameters[key], value, "x" if value == "string_param" else 1)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(message, timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert text in refused.value.details()


def test_a_regular_model_may_answer_through_its_response_sender(
    run_appliance, tmp_path: Path
) -> None:
    # Triton's python_backend: a non-decoupled model sends its one response, final
    _model(tmp_path, "sender", SENDER_PY, 'backend: "python"\nmax_batch_size: 0\n' + _IO)
    srv = run_appliance(tmp_path)
    http = httpclient.InferenceServerClient(srv.url)
    tensor = httpclient.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(np.asarray([3], np.float32))
    assert http.infer("sender", [tensor]).as_numpy("OUTPUT0").tolist() == [6.0]


# ---- cancellation -------------------------------------------------------------------

CANCEL_PY = """\
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

GATE = os.environ["QA_GATE_DIR"]


def mark(name):
    open(os.path.join(GATE, name), "w").close()


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            tag = str(int(value.reshape(-1)[0]))
            mark("started-" + tag)
            for _ in range(1200 if tag != "0" else 0):  # bounded: two minutes
                if request.is_cancelled():
                    mark("cancelled-" + tag)
                    error = pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED)
                    responses.append(pb_utils.InferenceResponse(error=error))
                    break
                time.sleep(0.1)
            else:
                out = pb_utils.Tensor("OUTPUT0", value)
                responses.append(pb_utils.InferenceResponse([out]))
        return responses
"""

UNTIL_CANCELLED_PY = """\
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

GATE = os.environ["QA_GATE_DIR"]


class TritonPythonModel:
    def execute(self, requests):
        request = requests[0]
        value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
        sender = request.get_response_sender()
        for _ in range(1200):  # bounded: two minutes
            if request.is_cancelled() and sender.is_cancelled():
                open(os.path.join(GATE, "cancelled-stream"), "w").close()
                error = pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED)
                sender.send(
                    pb_utils.InferenceResponse(error=error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                return None
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value)]))
            time.sleep(0.1)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def _until(done: Callable[[], bool], what: str) -> None:
    for _ in range(1200):  # bounded: two minutes
        if done():
            return
        time.sleep(0.1)
    raise AssertionError(f"never happened: {what}")


def _cancel_repo(repo: Path) -> Path:
    batching = 'backend: "python"\nmax_batch_size: 1\n' + _IO
    _model(repo, "execute_cancel", CANCEL_PY, batching)
    _model(repo, "execute_cancel_process", CANCEL_PY, batching + _PROCESS)
    _model(
        repo,
        "until_cancelled",
        UNTIL_CANCELLED_PY,
        'backend: "python"\nmax_batch_size: 0\n'
        "model_transaction_policy { decoupled: true }\n" + _IO,
    )
    return repo


def _http_body(model: str, value: int) -> bytes:
    doc = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [value]}]}
    data = json.dumps(doc).encode()
    return b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
        model.encode(),
        len(data),
        data,
    )


@pytest.mark.parametrize("model", ["execute_cancel", "execute_cancel_process"])
def test_a_reset_http_connection_reaches_the_running_model(
    run_appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("QA_GATE_DIR", str(gate))
    srv = run_appliance(_cancel_repo(tmp_path / "repo"))
    host, port = srv.url.split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(_http_body(model, 5))
        _until((gate / "started-5").exists, "the model started")
        # gone for good: a reset (a FIN alone is a half-close, which still gets its answer)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    _until((gate / "cancelled-5").exists, "the model saw is_cancelled()")
    # the instance serves the next request as usual (0: the model answers at once)
    status, _, answer = _exchange(srv.url, _http_body(model, 0))
    assert status == 200, answer


@pytest.mark.parametrize("model", ["execute_cancel", "execute_cancel_process"])
def test_a_cancelled_grpc_call_reaches_the_running_model(
    run_appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("QA_GATE_DIR", str(gate))
    srv = run_appliance(_cancel_repo(tmp_path / "repo"))
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.asarray([[7]], np.float32))
    answers: queue.Queue[object] = queue.Queue()
    call = grpc.async_infer(model, [tensor], lambda result, error: answers.put(error or result))
    _until((gate / "started-7").exists, "the model started")
    call.cancel()  # RST_STREAM
    _until((gate / "cancelled-7").exists, "the model saw is_cancelled()")
    assert isinstance(answers.get(timeout=60), InferenceServerException)


def test_a_closed_stream_reaches_a_decoupled_model(
    run_appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("QA_GATE_DIR", str(gate))
    srv = run_appliance(_cancel_repo(tmp_path / "repo"))
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    answers: queue.Queue[object] = queue.Queue()
    grpc.start_stream(callback=lambda result, error: answers.put(error or result))
    tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(np.asarray([3], np.float32))
    grpc.async_stream_infer("until_cancelled", [tensor])
    first = answers.get(timeout=60)
    assert first.as_numpy("OUTPUT0").tolist() == [3.0]  # type: ignore[union-attr]
    grpc.stop_stream(cancel_requests=True)
    _until((gate / "cancelled-stream").exists, "the model saw is_cancelled()")


def test_headers_a_pattern_names_are_forwarded_as_parameters(run_appliance, tmp_path: Path) -> None:
    # L0_parameters test_headers / test_grpc_header_forward_pattern_case_sensitive /
    # test_headers_reserved_rejected (Triton's --*-header-forward-pattern)
    repo = _parameter_repo(tmp_path)
    headers = {"header_1": "value_1", "my_header_1": "my_value_1", "my_header_2": "x y"}
    value = np.asarray([1], np.float32)

    def infer(client: object, module: object, **kwargs: object) -> object:
        tensor = module.InferInput("INPUT0", [1], "FP32")  # type: ignore[attr-defined]
        tensor.set_data_from_numpy(value)
        return client.infer("parameter", [tensor], headers=dict(headers), **kwargs)  # type: ignore[attr-defined]

    srv = run_appliance(
        repo, http_header_forward_pattern="MY_HEADER.*", grpc_header_forward_pattern="MY_HEADER.*"
    )
    wanted = {"my_header_1": "my_value_1", "my_header_2": "x y"}
    http = httpclient.InferenceServerClient(srv.url)
    grpc_client = grpcclient.InferenceServerClient(srv.grpc_url)
    for client, module in ((http, httpclient), (grpc_client, grpcclient)):
        _check(infer(client, module), wanted)
        _check(infer(client, module, parameters={"key1": 1}), {**wanted, "key1": 1})
    srv.stop()


def test_a_case_sensitive_or_reserved_header_pattern(run_appliance, tmp_path: Path) -> None:
    repo = _parameter_repo(tmp_path)
    srv = run_appliance(repo, grpc_header_forward_pattern="(?-i)MY_HEADER.*")
    grpc_client = grpcclient.InferenceServerClient(srv.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(np.asarray([1], np.float32))
    _check(grpc_client.infer("parameter", [tensor], headers={"my_header_1": "v"}), {})
    srv.stop()
    srv = run_appliance(repo, http_header_forward_pattern=".*", grpc_header_forward_pattern=".*")
    status, _, answer = _post(
        srv.url,
        "/v2/models/parameter/infer",
        json.dumps(
            {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
        ).encode(),
        {"timeout": "dummy-value"},
    )
    assert status == 400
    assert b"Header 'timeout' is reserved for Triton usage and cannot be forwarded." in answer
    grpc_client = grpcclient.InferenceServerClient(srv.grpc_url)
    with pytest.raises(InferenceServerException, match="Header 'priority' is reserved"):
        grpc_client.infer("parameter", [tensor], headers={"priority": "1"})


def test_a_header_pattern_that_is_no_regular_expression_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="http_header_forward_pattern: expected a regular"):
        load_server_config(None, {"http_header_forward_pattern": "MY_(HEADER"})


BLS_PARAMETER_PY = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="parameter",
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0")],
                requested_output_names=["key", "value"],
                parameters={"bls": "yes", "n": 3, "flag": False},
            )
            response = call.exec()
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            out.append(pb_utils.InferenceResponse(response.output_tensors()))
        return out
"""


def test_a_bls_requests_parameters_reach_the_called_model(run_appliance, tmp_path: Path) -> None:
    repo = _parameter_repo(tmp_path)
    _model(repo, "bls_parameter", BLS_PARAMETER_PY, _PARAMETER_CONFIG)
    srv = run_appliance(repo)
    http = httpclient.InferenceServerClient(srv.url)
    tensor = httpclient.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(np.asarray([1], np.float32))
    _check(http.infer("bls_parameter", [tensor]), {"bls": "yes", "n": 3, "flag": False})
