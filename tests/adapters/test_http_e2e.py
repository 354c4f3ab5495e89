"""End to end over HTTP with the unmodified tritonclient.http client."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def test_demo_simple_add_sub(run_appliance) -> None:
    srv = run_appliance()  # the built-in demo repository
    client = httpclient.InferenceServerClient(srv.url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple")
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    for binary in (True, False):
        inputs = [
            httpclient.InferInput("INPUT0", [1, 16], "INT32"),
            httpclient.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        inputs[0].set_data_from_numpy(a, binary_data=binary)
        inputs[1].set_data_from_numpy(b, binary_data=binary)
        outputs = [
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
            httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary),
        ]
        result = client.infer("simple", inputs, outputs=outputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_demo_classifier(run_appliance) -> None:
    srv = run_appliance()
    client = httpclient.InferenceServerClient(srv.url)
    images = np.random.default_rng(0).random((2, 3, 224, 224), dtype=np.float32)
    inp = httpclient.InferInput("input", list(images.shape), "FP32")
    inp.set_data_from_numpy(images)
    probs = client.infer("classifier", [inp]).as_numpy("output")
    assert probs.shape == (2, 1000)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-4)
    top = client.infer(
        "classifier", [inp], outputs=[httpclient.InferRequestedOutput("output", class_count=3)]
    ).as_numpy("output")
    assert top.shape == (2, 3)
    best = [int(x.decode().split(":")[1]) for x in top[:, 0]]
    assert best == list(np.argmax(probs, axis=1))


def test_metadata_config_and_statistics(run_appliance, test_repository: Path) -> None:
    srv = run_appliance(test_repository)
    client = httpclient.InferenceServerClient(srv.url)
    meta = client.get_model_metadata("simple")
    assert meta["platform"] == "onnxruntime_onnx"
    assert [i["shape"] for i in meta["inputs"]] == [[-1, 16], [-1, 16]]
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 8
    assert config["input"][0]["data_type"] == "TYPE_INT32"
    a = np.ones((2, 16), dtype=np.int32)
    inputs = [httpclient.InferInput(n, [2, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(a)
    client.infer("simple", inputs)
    stats = client.get_inference_statistics("simple")["model_stats"][0]
    assert stats["name"] == "simple" and stats["version"] == "1"
    assert stats["inference_count"] == 2 and stats["execution_count"] == 1
    s = stats["inference_stats"]
    for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert set(s[key]) == {"count", "ns"}
    assert s["success"]["count"] == 1 and s["compute_infer"]["ns"] > 0
    assert stats["batch_stats"][0]["batch_size"] == 2
    all_stats = client.get_inference_statistics()["model_stats"]
    assert {m["name"] for m in all_stats} >= {"simple", "classifier", "mlp_auto"}


def test_auto_complete_from_onnx(run_appliance, test_repository: Path) -> None:
    srv = run_appliance(test_repository)
    client = httpclient.InferenceServerClient(srv.url)
    mlp = client.get_model_config("mlp_auto")
    assert mlp["max_batch_size"] == 8  # dynamic first dim -> batching, the server default
    assert mlp["input"] == [
        {
            "name": "input",
            "data_type": "TYPE_FP32",
            "format": "FORMAT_NONE",
            "dims": [256],
            "optional": False,
        }
    ]
    assert "dynamic_batching" in mlp
    fixed = client.get_model_config("no_batch_add")
    assert fixed["max_batch_size"] == 0 and fixed["input"][0]["dims"] == [4]
    x = np.arange(4, dtype=np.float32)
    inputs = [httpclient.InferInput(n, [4], "FP32") for n in ("A", "B")]
    for i in inputs:
        i.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("no_batch_add", inputs).as_numpy("SUM"), 2 * x)


def test_invalid_config_fails_alone(run_appliance, test_repository: Path) -> None:
    srv = run_appliance(test_repository)
    client = httpclient.InferenceServerClient(srv.url)
    index = {r["name"]: r for r in client.get_model_repository_index()}
    assert index["broken_config"]["state"] == "UNAVAILABLE"
    assert (
        "config.yaml: max_batch_size: expected an integer >= 0" in index["broken_config"]["reason"]
    )
    assert index["simple"]["state"] == "READY"
    assert not client.is_model_ready("broken_config")
    with pytest.raises(InferenceServerException, match="not ready"):
        inp = httpclient.InferInput("INPUT0", [1, 16], "INT32")
        inp.set_data_from_numpy(np.zeros((1, 16), np.int32))
        client.infer("broken_config", [inp])


@pytest.mark.parametrize(
    "datatype",
    [
        "BOOL",
        "UINT8",
        "UINT16",
        "UINT32",
        "UINT64",
        "INT8",
        "INT16",
        "INT32",
        "INT64",
        "FP16",
        "FP32",
        "FP64",
        "BYTES",
    ],
)
def test_every_datatype_round_trips(run_appliance, test_repository: Path, datatype: str) -> None:
    srv = run_appliance(test_repository)
    client = httpclient.InferenceServerClient(srv.url)
    rng = np.random.default_rng(1)
    if datatype == "BYTES":
        data = np.array([[b"hello", "wörld".encode(), b""]], dtype=object)
    elif datatype == "BOOL":
        data = rng.random((2, 3)) > 0.5
    else:
        names = {"FP16": "float16", "FP32": "float32", "FP64": "float64"}
        dtype = np.dtype(names.get(datatype, datatype.lower()))
        data = (rng.random((2, 3)) * 100).astype(dtype)
    for binary in (True, False):
        inp = httpclient.InferInput("INPUT0", list(data.shape), datatype)
        inp.set_data_from_numpy(data, binary_data=binary)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
        got = client.infer(f"identity_{datatype.lower()}", [inp], outputs=[out]).as_numpy("OUTPUT0")
        assert got.shape == data.shape
        if datatype == "BYTES":
            assert [x if isinstance(x, bytes) else x.encode() for x in got.ravel()] == list(
                data.ravel()
            )
        else:
            np.testing.assert_array_equal(got.astype(data.dtype), data)
