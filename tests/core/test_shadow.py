"""Shadow traffic against real servers: a sample of live unversioned requests mirrored
to a candidate version, its outputs compared; live requests are answered by the
serving version as before, whatever the candidate does."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import urllib3
from mosquitto import wait_until

from appliance.core.shadow import Agreement, compare
from devtools import modelgen

X = np.random.default_rng(11).standard_normal((1, 256)).astype(np.float32)
BODY = {
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 256], "data": X.ravel().tolist()}]
}


def _post(url: str, path: str, doc: Any) -> tuple[int, Any]:
    r = urllib3.request("POST", url + path, json=doc, retries=False)
    return r.status, json.loads(r.data) if r.data else None


def _report(url: str, model: str = "m") -> dict[str, Any]:
    r = urllib3.request("GET", f"{url}/v2/repository/models/{model}/shadow", retries=False)
    assert r.status == 200, r.data
    doc: dict[str, Any] = json.loads(r.data)
    return doc


def _load(
    url: str, versions: list[int], default: int = 0, model: str = "m", config: Any = None
) -> None:
    params: dict[str, Any] = {
        "config": json.dumps(
            {**(config or {}), "version_policy": {"specific": {"versions": versions}}}
        )
    }
    if default:
        params["default_version"] = default
    status, body = _post(url, f"/v2/repository/models/{model}/load", {"parameters": params})
    assert status == 200, body


def _mirror_until(
    url: str, compared: int, body: dict[str, Any] = BODY, model: str = "m"
) -> list[str]:
    """Send unversioned requests (bounded) until ``compared`` were compared; the
    versions that answered them."""
    answered: list[str] = []

    def enough() -> bool:
        status, doc = _post(url, f"/v2/models/{model}/infer", body)
        assert status == 200, doc
        answered.append(doc["model_version"])
        return _report(url, model)["compared"] >= compared or len(answered) >= 500

    wait_until(enough, timeout=60, what="mirrored requests")
    return answered


@pytest.fixture
def device(tmp_path: Path, run_appliance: Any) -> str:
    folder = modelgen.write_model(tmp_path, "m", modelgen.mlp(seed=1), "max_batch_size: 8\n", 1)
    shutil.copytree(folder / "1", folder / "3")  # the same weights as version 1
    (folder / "2").mkdir()
    (folder / "2" / "model.onnx").write_bytes(modelgen.mlp(seed=1, retrained=(2, 5)))
    srv = run_appliance(tmp_path, model_control_mode="explicit", load_model=["m"])
    return f"http://{srv.url}"


def test_a_copy_of_the_serving_version_agrees_exactly(device: str) -> None:
    _load(device, [1, 3], default=1, config={"max_batch_size": 8})
    status, first = _post(
        device,
        "/v2/repository/models/m/shadow",
        {"parameters": {"version": 3, "sample_rate": 1, "max_requests": 10}},
    )
    assert status == 200, first
    assert (first["serving_version"], first["version"], first["active"]) == (1, 3, True)
    answered = _mirror_until(device, 10)
    assert set(answered) == {"1"}  # live traffic stayed on the serving version
    report = _report(device)
    assert report["compared"] == 10 and report["failed"] == 0 and not report["active"]
    out = report["outputs"]["output"]
    assert out == {"rows": 10, "top1_agree": 10, "max_abs_diff": 0.0, "mismatched": 0}
    # requests by explicit version are never mirrored
    offered = report["offered"]
    assert _post(device, "/v2/models/m/versions/1/infer", BODY)[0] == 200
    assert _report(device)["offered"] == offered


def test_a_retrained_candidate_shows_its_differences_and_the_next_load_ends_it(device: str) -> None:
    _load(device, [1, 2], default=1, config={"max_batch_size": 8})
    params = {"version": "2", "sample_rate": "1.0", "max_requests": 5}
    assert _post(device, "/v2/repository/models/m/shadow", {"parameters": params})[0] == 200
    _mirror_until(device, 5)
    out = _report(device)["outputs"]["output"]
    assert out["rows"] == 5 and out["max_abs_diff"] > 0 and out["mismatched"] == 0

    assert (
        _post(
            device,
            "/v2/repository/models/m/shadow",
            {"parameters": {"version": 2, "max_requests": 1000}},
        )[0]
        == 200
    )
    _load(device, [2], config={"max_batch_size": 8})  # the switch
    assert not _report(device)["active"]
    before = _report(device)["offered"]
    assert _post(device, "/v2/models/m/infer", BODY)[1]["model_version"] == "2"
    assert _report(device)["offered"] == before


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"version": 9}, "must name a loaded version of model 'm' ([1, 2]), got 9"),
        ({"version": 1}, "is the one serving: nothing to shadow"),
        ({"version": 2, "sample_rate": 2}, "'sample_rate' must be a number in [1e-06, 1]"),
        ({"version": 2, "max_in_flight": 0}, "'max_in_flight' must be a number in [1, 16]"),
        ({"version": 2, "colour": "red"}, "unsupported shadow parameter(s) ['colour']"),
    ],
)
def test_bad_shadow_parameters_are_a_clear_400(device: str, params: Any, expected: str) -> None:
    status, _ = _post(device, "/v2/models/m/infer", BODY)
    r = urllib3.request("GET", f"{device}/v2/repository/models/m/shadow", retries=False)
    assert r.status == 404 and b"no shadow traffic" in r.data
    _load(device, [1, 2], default=1, config={"max_batch_size": 8})
    status, body = _post(device, "/v2/repository/models/m/shadow", {"parameters": params})
    assert status == 400 and expected in body["error"], body
    status, body = _post(device, "/v2/repository/models/m/shadow", {"parameters": []})
    assert status == 400 and "'parameters' must be an object" in body["error"]


FAILING = """
import numpy as np
from appliance import python_model as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if VERSION == 2:
                raise RuntimeError("the candidate is broken")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)]))
        return out
"""
PY_CONFIG = """
backend: python
max_batch_size: 8
input: [{name: IN, data_type: TYPE_FP32, dims: [3]}]
output: [{name: OUT, data_type: TYPE_FP32, dims: [3]}]
"""


def test_a_failing_candidate_never_fails_a_live_request(tmp_path: Path, run_appliance: Any) -> None:
    for v in (1, 2):
        (tmp_path / "py" / str(v)).mkdir(parents=True)
        code = textwrap.dedent(FAILING).replace("VERSION", str(v))
        (tmp_path / "py" / str(v) / "model.py").write_text(code)
    (tmp_path / "py" / "config.yaml").write_text(PY_CONFIG)
    url = f"http://{run_appliance(tmp_path, model_control_mode='explicit', load_model=['py']).url}"
    _load(url, [1, 2], default=1, model="py", config={
        "backend": "python", "max_batch_size": 8,
        "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [3]}],
        "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [3]}],
    })  # fmt: skip
    params = {"version": 2, "sample_rate": 1, "max_requests": 1000}
    assert _post(url, "/v2/repository/models/py/shadow", {"parameters": params})[0] == 200
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}

    def three_failed() -> bool:
        status, doc = _post(url, "/v2/models/py/infer", body)
        assert status == 200 and doc["outputs"][0]["data"] == [2, 4, 6], (
            doc
        )  # never the candidate's failure
        return _report(url, "py")["failed"] >= 3

    wait_until(three_failed, timeout=60, what="failed mirrored requests")
    assert _report(url, "py")["compared"] == 0


def test_compare_counts_top1_and_differences() -> None:
    a = np.array([[0.1, 0.9], [0.8, 0.2], [0.5, 0.4]], np.float32)
    b = np.array([[0.2, 0.8], [0.1, 0.9], [0.5, 0.4]], np.float32)
    agreement = Agreement()
    compare(a, b, agreement)
    assert (agreement.rows, agreement.top1_agree) == (3, 2)
    assert agreement.max_abs_diff == pytest.approx(0.7)
    compare(a, b[:2], agreement)
    assert agreement.mismatched == 1
    nan = Agreement()
    compare(np.array([np.nan, 1.0]), np.array([np.nan, 1.0]), nan)
    assert nan.max_abs_diff == 0.0
    compare(np.array([np.nan, 1.0]), np.array([0.0, 1.0]), nan)
    assert nan.max_abs_diff == float("inf") and nan.json()["max_abs_diff"] == "inf"
    text = Agreement()
    compare(np.array([b"a", b"b"], object), np.array([b"a", b"c"], object), text)
    assert (text.rows, text.top1_agree, text.max_abs_diff) == (2, 1, float("inf"))
