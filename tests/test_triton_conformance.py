"""Triton conformance: tritonclient (HTTP, gRPC, aio, streaming) against a repository
written the way Triton's documentation writes one (``tests/triton_repository.py``).

Each test follows Triton's documented behaviour: Python models importing
``triton_python_backend_utils`` (with BLS and ``async def execute``), a decoupled
model streamed over gRPC, ``reshape``, ``label_filename``, ``format`` and optional
inputs, CUDA shared-memory routes on a CPU device, Triton's error texts, server
metadata and ``GET /v2/models``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.http_helpers import post_json
from tests.triton_repository import LABELS, write_triton_repository


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_triton_repository(tmp_path_factory.mktemp("triton_repo"))


@pytest.fixture
def server(run_appliance: Any, triton_repo: Path) -> Any:
    return run_appliance(triton_repo)


def _fails(call: Callable[[], Any], *words: str, status: str | None = None) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    message = info.value.message()
    for word in words:
        assert word in message, message
    if status is not None:
        assert str(info.value.status()) in (status, f"StatusCode.{status}"), info.value
    return message


def _http_inputs(**arrays: np.ndarray) -> list[httpclient.InferInput]:
    out = []
    for name, arr in arrays.items():
        tensor = httpclient.InferInput(name, list(arr.shape), _dtype(arr))
        tensor.set_data_from_numpy(arr)
        out.append(tensor)
    return out


def _grpc_inputs(**arrays: np.ndarray) -> list[grpcclient.InferInput]:
    out = []
    for name, arr in arrays.items():
        tensor = grpcclient.InferInput(name, list(arr.shape), _dtype(arr))
        tensor.set_data_from_numpy(arr)
        out.append(tensor)
    return out


def _dtype(arr: np.ndarray) -> str:
    return {"float32": "FP32", "int32": "INT32", "uint32": "UINT32"}[str(arr.dtype)]


X = np.array([1.0, 2.0, 3.0, 4.0], np.float32)  # add_sub does not batch: dims [4]
Y = np.array([0.5, 0.5, 0.5, 0.5], np.float32)


# ---- Python models, unchanged -------------------------------------------------------------


def test_triton_python_model_runs_unchanged(server: Any) -> None:
    http = httpclient.InferenceServerClient(server.url)
    result = http.infer("add_sub", _http_inputs(INPUT0=X, INPUT1=Y))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X + Y)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), X - Y)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    result = grpc.infer("add_sub", _grpc_inputs(INPUT0=X, INPUT1=Y))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), X - Y)
    # an error the model puts in its response reaches the client, and the model goes on
    bad = X.copy()
    bad[0] = np.nan
    _fails(lambda: http.infer("add_sub", _http_inputs(INPUT0=bad, INPUT1=Y)), "holds a NaN")
    assert http.infer("add_sub", _http_inputs(INPUT0=X, INPUT1=Y)).as_numpy("OUTPUT0") is not None


def test_bls_calls_other_models_from_async_execute(server: Any) -> None:
    """exec() to a Python model, async_exec() to an ONNX model, exec() to an unknown
    model (an error response, not an exception), all inside ``async def execute``."""
    client = httpclient.InferenceServerClient(server.url)

    def add_sub_count() -> int:
        stats = client.get_inference_statistics("add_sub")["model_stats"][0]
        return int(stats["inference_stats"]["success"]["count"])

    before = add_sub_count()  # the bls model's warm-up probe may have called it
    for _ in range(3):  # the instance thread is free again after each call
        result = client.infer("bls", _http_inputs(X=X))
        np.testing.assert_array_equal(result.as_numpy("Y"), X * 2)
        np.testing.assert_array_equal(result.as_numpy("Z"), np.full(16, 2, np.int32))
    assert add_sub_count() == before + 3  # through the data plane, counted


def test_bls_collects_the_responses_of_a_decoupled_model(server: Any) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    values = np.array([3, 1, 4, 1, 5], np.int32)
    result = client.infer("bls_repeat", _grpc_inputs(IN=values))
    np.testing.assert_array_equal(result.as_numpy("OUT"), values)


def test_optional_input_may_be_left_out(server: Any) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    a = np.array([1.0, 2.0], np.float32)
    result = client.infer("optional_in", _grpc_inputs(A=a))
    np.testing.assert_array_equal(result.as_numpy("SUM"), a)
    result = client.infer("optional_in", _grpc_inputs(A=a, B=a))
    np.testing.assert_array_equal(result.as_numpy("SUM"), a * 2)


# ---- decoupled --------------------------------------------------------------------------


def _repeat_inputs(values: list[int], delays: list[int]) -> list[grpcclient.InferInput]:
    return _grpc_inputs(
        IN=np.array(values, np.int32),
        DELAY=np.array(delays, np.uint32),
        WAIT=np.array([0], np.uint32),
    )


def _stream(server: Any, requests: list[dict[str, Any]]) -> list[Any]:
    """Send requests on one stream; collect (result, error) until each is final."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for kwargs in requests:
            client.async_stream_infer("repeat_int32", **kwargs)
        out = []
        finals = 0
        while finals < len(requests):
            result, error = got.get(timeout=30)
            out.append((result, error))
            if error is not None:
                finals += 1
                continue
            param = result.get_response().parameters.get("triton_final_response")
            finals += bool(param and param.bool_param)
    finally:
        client.stop_stream()
    return out


def test_decoupled_model_streams_each_response_and_the_final_flag(server: Any) -> None:
    values = [4, 2, 0, 1]
    got = _stream(
        server,
        [{"inputs": _repeat_inputs(values, [1, 0, 2, 0]), "enable_empty_final_response": True}],
    )
    assert all(error is None for _, error in got)
    outs = [r.as_numpy("OUT") for r, _ in got[:-1]]
    assert [int(o[0]) for o in outs] == values  # one response per element, in order
    assert [int(r.as_numpy("IDX")[0]) for r, _ in got[:-1]] == [0, 1, 2, 3]
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in got]
    assert finals == [False] * 4 + [True]
    assert not got[-1][0].get_response().outputs  # the final flag came on its own


def test_decoupled_without_empty_final_response_and_errors_in_stream(server: Any) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer("repeat_int32", _repeat_inputs([7, 8], [0, 0]))
        first = [got.get(timeout=30) for _ in range(2)]
        client.async_stream_infer("repeat_int32", _repeat_inputs([1, 2], [0]))  # bad shapes
        _, error = got.get(timeout=30)
        client.async_stream_infer("add_sub", _grpc_inputs(INPUT0=X, INPUT1=Y))  # regular
        regular, regular_error = got.get(timeout=30)
    finally:
        client.stop_stream()
    assert [int(r.as_numpy("OUT")[0]) for r, _ in first] == [7, 8]
    assert "IN and DELAY must have the same shape" in str(error)
    assert regular_error is None
    np.testing.assert_array_equal(regular.as_numpy("OUTPUT0"), X + Y)
    assert got.empty()  # no empty final response was asked for, none was sent


def test_decoupled_stream_with_aio_client(server: Any) -> None:
    async def run() -> list[int]:
        client = grpcaio.InferenceServerClient(server.grpc_url)

        async def requests() -> Any:
            yield {"model_name": "repeat_int32", "inputs": _repeat_inputs([5, 6, 7], [0, 1, 0])}

        values = []
        try:
            async for result, error in client.stream_infer(requests()):
                assert error is None, error
                values.append(int(result.as_numpy("OUT")[0]))
                if len(values) == 3:
                    break
        finally:
            await client.close()
        return values

    assert asyncio.run(run()) == [5, 6, 7]


ENSEMBLE_OF_DECOUPLED = """
name: "ens"
platform: "ensemble"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ -1 ] },
        { name: "D" data_type: TYPE_UINT32 dims: [ -1 ] },
        { name: "W" data_type: TYPE_UINT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [ {
  model_name: "repeat_int32"
  model_version: -1
  input_map { key: "IN" value: "X" }
  input_map { key: "DELAY" value: "D" }
  input_map { key: "WAIT" value: "W" }
  output_map { key: "OUT" value: "Y" }
} ] }
"""


ENSEMBLE_NO_BATCH = """
name: "ens_ok"
platform: "ensemble"
max_batch_size: 0
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ {
  model_name: "add_sub"
  model_version: -1
  input_map [ { key: "INPUT0" value: "A" }, { key: "INPUT1" value: "A" } ]
  output_map { key: "OUTPUT0" value: "SUM" }
} ] }
"""


def test_pbtxt_ensembles_without_batching_and_with_decoupled_steps(
    run_appliance: Any, tmp_path: Path
) -> None:
    repo = write_triton_repository(tmp_path / "repo")
    for name, text in (("ens", ENSEMBLE_OF_DECOUPLED), ("ens_ok", ENSEMBLE_NO_BATCH)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(text)
    srv = run_appliance(repo, load_model=["repeat_int32", "add_sub"])
    client = httpclient.InferenceServerClient(srv.url)
    # a decoupled step makes the ensemble decoupled: streamed only (Triton's; the
    # streaming itself: tests/core/test_ensemble_decoupled.py)
    client.load_model("ens")
    inputs = [
        httpclient.InferInput(n, [1], t).set_data_from_numpy(np.array([1], d))
        for n, t, d in (
            ("X", "INT32", np.int32),
            ("D", "UINT32", np.uint32),
            ("W", "UINT32", np.uint32),
        )
    ]
    _fails(
        lambda: client.infer("ens", inputs),
        "HTTP end point doesn't support models with decoupled transaction policy",
    )
    # "max_batch_size: 0" is what protobuf text leaves out: an ensemble then does not batch
    client.load_model("ens_ok")
    result = client.infer("ens_ok", _http_inputs(A=X))
    np.testing.assert_array_equal(result.as_numpy("SUM"), X * 2)


def test_decoupled_model_is_refused_on_unary_calls(server: Any) -> None:
    http = httpclient.InferenceServerClient(server.url)
    inputs = _http_inputs(
        IN=np.array([1], np.int32), DELAY=np.array([0], np.uint32), WAIT=np.array([0], np.uint32)
    )
    _fails(
        lambda: http.infer("repeat_int32", inputs),
        "HTTP end point doesn't support models with decoupled transaction policy",
    )
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    _fails(
        lambda: grpc.infer("repeat_int32", _repeat_inputs([1], [0])),
        "ModelInfer RPC doesn't support models with decoupled transaction policy",
        status="INVALID_ARGUMENT",
    )
    config = grpc.get_model_config("repeat_int32", as_json=True)["config"]
    assert config["model_transaction_policy"] == {"decoupled": True}


# ---- config fields --------------------------------------------------------------------------


def test_reshape_format_and_labels(server: Any) -> None:
    client = httpclient.InferenceServerClient(server.url)
    a = np.arange(16, dtype=np.int32).reshape(1, 1, 4, 4)
    b = np.ones((1, 16), np.int32)
    result = client.infer("reshaped", _http_inputs(INPUT0=a, INPUT1=b))
    assert result.as_numpy("OUTPUT0").shape == (1, 2, 8)  # dims, not the model's [16]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0").ravel(), a.ravel() + 1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a.reshape(1, 16) - 1)
    meta = client.get_model_metadata("reshaped")
    assert meta["inputs"][0]["shape"] == [-1, 1, 4, 4]
    config = client.get_model_config("reshaped")
    assert config["input"][0]["format"] == "FORMAT_NCHW"
    assert config["input"][0]["reshape"] == {"shape": [16]}
    assert config["output"][0]["reshape"] == {"shape": [16]}
    grpc_config = grpcclient.InferenceServerClient(server.grpc_url).get_model_config("reshaped")
    assert grpc_config.config.input[0].format == 2  # FORMAT_NCHW, through the protobuf schema

    scores = np.array([[0.1, 0.7, 0.05, 0.9, 0.2]], np.float32)
    out = httpclient.InferRequestedOutput("OUTPUT0", class_count=2)
    result = client.infer("labelled", _http_inputs(INPUT0=scores), outputs=[out])
    assert [s.decode() for s in result.as_numpy("OUTPUT0")[0]] == [
        f"0.900000:3:{LABELS[3]}",
        f"0.700000:1:{LABELS[1]}",
    ]
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    gout = grpcclient.InferRequestedOutput("OUTPUT0", class_count=1)
    result = grpc.infer("labelled", _grpc_inputs(INPUT0=scores), outputs=[gout])
    assert result.as_numpy("OUTPUT0")[0][0].decode() == "0.900000:3:fish"


# ---- wire details ---------------------------------------------------------------------------


def test_cuda_shared_memory_routes_answer_as_a_cpu_triton(server: Any) -> None:
    client = httpclient.InferenceServerClient(server.url)
    client.unregister_cuda_shared_memory()  # what tritonclient's shm examples do first
    client.unregister_cuda_shared_memory("some_region")
    assert client.get_cuda_shared_memory_status() == []
    _fails(
        lambda: client.register_cuda_shared_memory("r", b"handle", 0, 64),
        "not supported on this device",
    )


def test_errors_as_triton_words_them(server: Any, triton_repo: Path) -> None:
    http = httpclient.InferenceServerClient(server.url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = _http_inputs(INPUT0=X, INPUT1=Y)
    _fails(lambda: http.infer("nope", inputs), "Request for unknown model: 'nope' is not found")
    body_doc = {"inputs": [{"name": "A", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    status, body = post_json(f"http://{server.url}/v2/models/nope/infer", body_doc)
    assert status == 400 and json.loads(body) == {
        "error": "Request for unknown model: 'nope' is not found"
    }
    _fails(
        lambda: grpc.get_model_metadata("nope"),
        "Request for unknown model: 'nope' is not found",
        status="INVALID_ARGUMENT",
    )
    _fails(
        lambda: grpc.infer("add_sub", _grpc_inputs(INPUT0=X, INPUT1=Y), model_version="one"),
        "failed to get model version from specified version string 'one'",
        status="INVALID_ARGUMENT",
    )
    _fails(
        lambda: grpc.infer("add_sub", _grpc_inputs(INPUT0=X, INPUT1=Y), model_version="9"),
        "Request for unknown model: 'add_sub' version 9 is not found",
        status="NOT_FOUND",
    )
    broken = triton_repo / "broken"
    (broken / "1").mkdir(parents=True, exist_ok=True)
    (broken / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: -1\n')
    try:
        _fails(lambda: http.load_model("broken"), "failed to load 'broken'", "max_batch_size")
        _fails(lambda: grpc.load_model("missing"), "failed to load 'missing'")
        _fails(
            lambda: http.load_model("add_sub", files={"file:1/model.py": b"x"}),
            "failed to load 'add_sub'",
            "'config' must be provided",
        )
        _fails(
            lambda: grpc.load_model(
                "add_sub", config='{"backend": "python"}', files={"file:1/model.py": b"x"}
            ),
            "model files in a load request",
            status="INVALID_ARGUMENT",
        )
        # what Triton cannot load either answers INTERNAL with its words: a malformed
        # override config, a model file name no file system takes (Triton 2.51 aborts)
        unpolled = "failed to load 'add_sub', failed to poll from model repository: "
        for config in ("{not json", '{"max_batch_size": "x"}', "[]"):
            for call in (http.load_model, grpc.load_model):
                message = _fails(
                    lambda call=call, config=config: call("add_sub", config=config),
                    unpolled + "load request parameter 'config'",
                )
                assert "Traceback" not in message
        status, body = post_json(
            f"http://{server.url}/v2/repository/models/add_sub/load",
            {"parameters": {"config": 5}},
        )
        assert status == 500 and json.loads(body)["error"].startswith(unpolled)
        long_name = "file:1/" + "a" * 300 + ".py"
        for call, status in ((http.load_model, "500"), (grpc.load_model, "INTERNAL")):
            message = _fails(
                lambda call=call: call(
                    "add_sub", config='{"backend": "python"}', files={long_name: b"x"}
                ),
                unpolled + "model file 'file:1/aaaa",
                "has a path component of 303 bytes; a file name has at most 255",
                status=status,
            )
            assert len(message) < 400  # the name is not echoed whole
        _fails(
            lambda: grpc.load_model("add_sub", config="{not json"),
            status="INTERNAL",
        )
    finally:
        (broken / "config.pbtxt").unlink()
        (broken / "1").rmdir()
        broken.rmdir()
    assert http.is_model_ready("add_sub")  # nothing of it disturbed what serves


def test_server_metadata_name_and_extensions(run_appliance: Any, triton_repo: Path) -> None:
    srv = run_appliance(triton_repo, server_name="triton", shared_memory="system")
    meta = httpclient.InferenceServerClient(srv.url).get_server_metadata()
    assert meta["name"] == "triton"
    assert set(meta["extensions"]) >= {
        "classification",
        "model_repository",
        "model_configuration",
        "system_shared_memory",
        "binary_tensor_data",
        "statistics",
        "parameters",
    }
    assert "cuda_shared_memory" not in meta["extensions"]  # registering one is refused here
    grpc_meta = grpcclient.InferenceServerClient(srv.grpc_url).get_server_metadata()
    assert grpc_meta.name == "triton" and list(grpc_meta.extensions) == meta["extensions"]


def test_model_list_route(server: Any) -> None:
    with urllib.request.urlopen(f"http://{server.url}/v2/models", timeout=30) as response:
        doc = json.loads(response.read())
    names = {row["name"] for row in doc["models"]}
    assert {"add_sub", "repeat_int32", "bls", "reshaped", "labelled", "simple"} <= names


# ---- trace and logging ----------------------------------------------------------------------


def _wait_for(path: Path, timeout_s: float = 20.0) -> list[dict[str, Any]]:
    """The trace file's records once it is written (written on a worker thread)."""
    for _ in range(int(timeout_s / 0.05)):
        if path.is_file():
            try:
                records: list[dict[str, Any]] = json.loads(path.read_text())
                return records
            except json.JSONDecodeError:
                pass  # being written
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written")


def test_trace_settings_and_trace_files(
    run_appliance: Any, triton_repo: Path, tmp_path: Path
) -> None:
    trace_file = tmp_path / "trace.json"
    srv = run_appliance(triton_repo, trace_file=str(trace_file))
    http = httpclient.InferenceServerClient(srv.url)
    assert http.get_trace_settings()["trace_level"] == ["OFF"]
    assert http.get_trace_settings()["trace_file"] == str(trace_file)
    settings = http.update_trace_settings(
        settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "log_frequency": "2"}
    )
    assert settings["trace_level"] == ["TIMESTAMPS"] and settings["trace_rate"] == "1"
    # a model of its own: add_sub not traced; then back to the server's settings
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    own = grpc.update_trace_settings("add_sub", {"trace_level": ["OFF"]}, as_json=True)
    assert own["settings"]["trace_level"]["value"] == ["OFF"]
    ones = np.ones((1, 16), np.int32)
    for i in range(4):
        http.infer("simple", _http_inputs(INPUT0=ones, INPUT1=ones), request_id=f"r{i}")
        http.infer("add_sub", _http_inputs(INPUT0=X, INPUT1=Y))
    first, second = _wait_for(Path(f"{trace_file}.0")), _wait_for(Path(f"{trace_file}.1"))
    records = first + second
    heads = [r for r in records if "model_name" in r]
    assert [(h["model_name"], h["model_version"], h["request_id"]) for h in heads] == [
        ("simple", 1, f"r{i}") for i in range(4)
    ]
    names = [
        "REQUEST_START",
        "QUEUE_START",
        "COMPUTE_START",
        "COMPUTE_INPUT_END",
        "COMPUTE_OUTPUT_START",
        "COMPUTE_END",
        "REQUEST_END",
    ]
    for r in records:
        if "timestamps" in r:
            assert [t["name"] for t in r["timestamps"]] == names
            stamps = [t["ns"] for t in r["timestamps"]]
            assert stamps == sorted(stamps)  # one monotonic clock, in Triton's order
    cleared = http.update_trace_settings("add_sub", {"trace_level": None})
    assert cleared["trace_level"] == ["TIMESTAMPS"]  # the server's again
    _fails(lambda: http.update_trace_settings(settings={"trace_file": "/tmp/x"}), "trace_file")
    _fails(lambda: http.update_trace_settings(settings={"trace_level": ["TENSORS"]}), "TENSORS")
    _fails(lambda: http.get_trace_settings("nope"), "Request for unknown model: 'nope'")
    count = http.update_trace_settings(settings={"trace_count": "1", "log_frequency": "0"})
    assert count["trace_count"] == "1"
    http.infer("simple", _http_inputs(INPUT0=ones, INPUT1=ones))
    assert http.get_trace_settings()["trace_count"] == "0"  # one trace taken, then none
    http.update_trace_settings(settings={"trace_level": ["OFF"]})  # writes the last file
    assert len([r for r in _wait_for(trace_file) if "model_name" in r]) == 1


def test_tracing_needs_a_trace_file(server: Any) -> None:
    # as Triton 2.51 (tritonserver from the nvidia-pytriton 0.7.0 wheel) answers with no
    # trace file: turning tracing on is refused, every other setting is taken (200)
    http = httpclient.InferenceServerClient(server.url)
    _fails(
        lambda: http.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}),
        "trace file name is not given",
        "set trace_file in the server config",
    )
    assert http.get_trace_settings()["trace_level"] == ["OFF"]
    url = f"http://{server.url}/v2/trace/setting"
    status, body = post_json(url, {"trace_rate": "1", "trace_count": "5", "log_frequency": "2"})
    assert status == 200
    assert json.loads(body) == {
        "trace_level": ["OFF"],
        "trace_rate": "1",
        "trace_count": "5",
        "log_frequency": "2",
        "trace_file": "",
        "trace_mode": "triton",
    }
    for cleared in ({"trace_rate": None}, {"trace_level": []}, {"trace_level": ["OFF"]}, {}):
        status, body = post_json(url, cleared)
        assert status == 200, (cleared, body)
    assert json.loads(body)["trace_rate"] == "1000"  # Triton's default again
    status, body = post_json(f"http://{server.url}/v2/models/simple/trace/setting", {})
    assert status == 200 and json.loads(body)["trace_count"] == "5"
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    over_grpc = grpc.update_trace_settings(settings={"trace_count": None}, as_json=True)
    assert over_grpc["settings"]["trace_count"]["value"] == ["-1"]


def test_log_settings_change_the_level_at_run_time(server: Any) -> None:
    root = logging.getLogger()
    before = root.level
    http = httpclient.InferenceServerClient(server.url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        settings = http.get_log_settings()
        assert settings["log_file"] == "" and settings["log_error"] is True
        assert http.update_log_settings({"log_verbose_level": 1})["log_verbose_level"] == 1
        assert root.level == logging.DEBUG
        reply = grpc.update_log_settings({"log_verbose_level": 0, "log_info": False}, as_json=True)
        assert reply["settings"]["log_info"]["bool_param"] is False
        assert root.level == logging.WARNING
        got = grpc.get_log_settings(as_json=True)["settings"]
        assert got["log_warning"]["bool_param"] is True
        _fails(
            lambda: http.update_log_settings({"log_file": "/tmp/x.log"}),
            "log file location can not be updated through network protocol",
        )
        _fails(lambda: http.update_log_settings({"log_info": "yes"}), "true or false")
    finally:
        root.setLevel(before)


def test_statistics_parse_strictly_into_tritons_message(server: Any) -> None:
    """Clients that parse the statistics JSON strictly into Triton's protobuf message
    (json_format without ignore_unknown_fields) must find no field of ours in it."""
    from google.protobuf import json_format
    from tritonclient.grpc import service_pb2

    http = httpclient.InferenceServerClient(server.url)
    ones = np.ones((1, 16), np.int32)
    http.infer("simple", _http_inputs(INPUT0=ones, INPUT1=ones))
    http.infer("add_sub", _http_inputs(INPUT0=X, INPUT1=Y))
    with pytest.raises(InferenceServerException):  # a failure is counted too
        http.infer("add_sub", _http_inputs(INPUT0=X[:2], INPUT1=Y[:2]))
    parsed = {}
    for url in ("models/stats", "models/simple/stats", "models/add_sub/versions/1/stats"):
        with urllib.request.urlopen(f"http://{server.url}/v2/{url}", timeout=30) as response:
            text = response.read().decode()
        parsed[url] = json_format.Parse(text, service_pb2.ModelStatisticsResponse())
    by_name = {s.name: s for s in parsed["models/stats"].model_stats}
    assert by_name["simple"].inference_count == 1
    assert by_name["simple"].batch_stats[0].batch_size == 1
    assert by_name["simple"].memory_usage[0].type == "CPU"
    assert parsed["models/simple/stats"].model_stats[0].inference_stats.success.count == 1
    assert parsed["models/add_sub/versions/1/stats"].model_stats[0].version == "1"
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    assert grpc.get_inference_statistics("simple").model_stats[0].inference_count == 1
