"""The Python backend end to end: a real server, real model.py files, tritonclient."""

from __future__ import annotations

import asyncio
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from appliance.config.server_config import load_server_config
from appliance.core.lifecycle import ModelLifeCycle

MODEL_PY = """
import json
import time

import numpy as np

from appliance import python_model as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.config = json.loads(args["model_config"])
        out = pb_utils.get_output_config_by_name(self.config, "OUT")
        self.dtype = pb_utils.triton_string_to_numpy(out["data_type"])
        self.name = args["model_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()
            if (mode == 1).any():
                raise RuntimeError("boom")
            if (mode == 2).any():
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("bad input", pb_utils.TritonError.INVALID_ARG)))
                continue
            if (mode == 3).any():
                time.sleep(1.5)
            out = pb_utils.Tensor("OUT", (x * 2).astype(self.dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses

    def finalize(self):
        pass
"""

CONFIG = """
backend: python
max_batch_size: 8
dynamic_batching: {}
parameters:
  execute_timeout_s: "0.5"
input:
  - {name: IN, data_type: TYPE_FP32, dims: [3]}
  - {name: MODE, data_type: TYPE_INT32, dims: [1]}
output:
  - {name: OUT, data_type: TYPE_FP32, dims: [3]}
"""


def write_python_model(repo: Path, name: str, source: str, config: str | None) -> None:
    version = repo / name / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(textwrap.dedent(source))
    if config is not None:
        (repo / name / "config.yaml").write_text(config)


def _infer(client: httpclient.InferenceServerClient, x: np.ndarray, mode: int) -> np.ndarray:
    a = httpclient.InferInput("IN", list(x.shape), "FP32")
    a.set_data_from_numpy(x)
    m = httpclient.InferInput("MODE", [x.shape[0], 1], "INT32")
    m.set_data_from_numpy(np.full((x.shape[0], 1), mode, dtype=np.int32))
    result = client.infer("double", [a, m])
    out: np.ndarray = result.as_numpy("OUT")
    return out


def test_python_model_serves_errors_and_recovers(run_appliance, tmp_path: Path) -> None:
    write_python_model(tmp_path, "double", MODEL_PY, CONFIG)
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(_infer(client, x, 0), x * 2)

    with pytest.raises(InferenceServerException) as raised:
        _infer(client, x, 1)
    assert raised.value.status() == "500"
    assert "RuntimeError: boom" in str(raised.value)

    with pytest.raises(InferenceServerException) as raised:
        _infer(client, x, 2)
    assert raised.value.status() == "400"
    assert "bad input" in str(raised.value)

    with pytest.raises(InferenceServerException) as raised:
        _infer(client, x, 3)
    assert raised.value.status() == "503"
    assert "did not finish within 0.5s" in str(raised.value)

    # the abandoned call finishes; the model serves again
    for _ in range(50):
        try:
            np.testing.assert_array_equal(_infer(client, x, 0), x * 2)
            break
        except InferenceServerException as exc:
            assert exc.status() == "503"
            time.sleep(0.1)
    else:
        pytest.fail("the model did not recover after its timed-out execute")

    stats = client.get_inference_statistics("double")["model_stats"][0]["inference_stats"]
    assert stats["fail"]["count"] >= 3
    metrics = urllib.request.urlopen(srv.metrics_url).read().decode()
    assert 'nv_inference_request_failure{model="double",reason="BACKEND",version="1"}' in metrics
    assert client.is_server_live()


def test_python_model_metadata_comes_from_its_config(run_appliance, tmp_path: Path) -> None:
    write_python_model(tmp_path, "double", MODEL_PY, CONFIG)
    srv = run_appliance(tmp_path)
    meta = httpclient.InferenceServerClient(srv.url).get_model_metadata("double")
    assert meta["inputs"][0] == {"name": "IN", "datatype": "FP32", "shape": [-1, 3]}
    assert meta["outputs"] == [{"name": "OUT", "datatype": "FP32", "shape": [-1, 3]}]


async def _load(repo: Path, name: str) -> str:
    server = load_server_config(None, {"model_repository": repo, "model_control_mode": "explicit"})
    lifecycle = ModelLifeCycle(repo, server)
    entry = await lifecycle.load(name)
    try:
        return entry.reason
    finally:
        await lifecycle.stop(5)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("backend: python\n", "declare every input and output in its config"),
        (
            "backend: python\ninput:\n  - {name: IN, data_type: TYPE_FP32, dims: [3]}\n",
            "output: a Python model has no graph",
        ),
    ],
)
def test_python_model_without_declared_tensors_is_a_config_error(
    tmp_path: Path, config: str, expected: str
) -> None:
    write_python_model(tmp_path, "double", MODEL_PY, config)
    reason = asyncio.run(_load(tmp_path, "double"))
    assert expected in reason
    assert "config.yaml" in reason


def test_python_model_that_fails_to_initialize_does_not_load(tmp_path: Path) -> None:
    source = (
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise ValueError('nope')\n"
    )
    write_python_model(tmp_path, "double", source, CONFIG)
    reason = asyncio.run(_load(tmp_path, "double"))
    assert "ValueError" in reason or "nope" in reason


HELPER_MODEL_PY = """
import numpy as np
import utils
from appliance import python_model as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", utils.transform(x).astype(np.float32))]))
        return responses
"""

HELPER_CONFIG = """
backend: python
max_batch_size: 4
parameters: {{execution: {execution}}}
input:
  - {{name: IN, data_type: TYPE_FP32, dims: [3]}}
output:
  - {{name: OUT, data_type: TYPE_FP32, dims: [3]}}
"""


def _helper_model(repo: Path, name: str, version: int, body: str, execution: str) -> None:
    folder = repo / name / str(version)
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(textwrap.dedent(HELPER_MODEL_PY))
    (folder / "utils.py").write_text(f"def transform(x):\n    return {body}\n")
    (repo / name / "config.yaml").write_text(HELPER_CONFIG.format(execution=execution))


def _out(client: httpclient.InferenceServerClient, model: str) -> np.ndarray:
    a = httpclient.InferInput("IN", [1, 3], "FP32")
    a.set_data_from_numpy(np.array([[1, 2, 3]], np.float32))
    out: np.ndarray = client.infer(model, [a]).as_numpy("OUT")
    return out


@pytest.mark.parametrize("execution", ["in_process", "process"])
def test_two_python_models_with_a_utils_py_each_run_their_own(
    run_appliance, tmp_path: Path, execution: str
) -> None:
    import sys

    _helper_model(tmp_path, "plus", 1, "x + 1", execution)
    _helper_model(tmp_path, "times", 1, "x * 10", execution)
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url)
    np.testing.assert_array_equal(_out(client, "plus"), [[2, 3, 4]])
    np.testing.assert_array_equal(_out(client, "times"), [[10, 20, 30]])
    assert "utils" not in sys.modules  # the server's own namespace is untouched


@pytest.mark.parametrize("execution", ["in_process", "process"])
def test_a_hot_swap_to_a_version_with_a_changed_utils_py_runs_the_new_helper(
    run_appliance, tmp_path: Path, execution: str
) -> None:
    _helper_model(tmp_path, "m", 1, "x + 1", execution)
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url)
    np.testing.assert_array_equal(_out(client, "m"), [[2, 3, 4]])
    folder = tmp_path / "m" / "2"  # what an OTA install adds: a new version folder
    folder.mkdir()
    (folder / "model.py").write_text((tmp_path / "m" / "1" / "model.py").read_text())
    (folder / "utils.py").write_text("def transform(x):\n    return x - 1\n")
    client.load_model("m")  # the default policy serves the latest version only
    np.testing.assert_array_equal(_out(client, "m"), [[0, 1, 2]])
    ready = [m["version"] for m in client.get_model_repository_index() if m["state"] == "READY"]
    assert ready == ["2"]  # version 1 may still be unloading
