"""Triton's identity backend (``backend: "identity"``): the models Triton's QA suite
builds with it load and answer as on Triton: OUTPUT<i> a copy of INPUT<i>, an optional
input left out answered with zeros, Triton's refusals of a config that does not pair
its tensors, and an ensemble whose steps are identity models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

FP32 = """
name: "identity_fp32"
backend: "identity"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""

BYTES = """
name: "identity_bytes"
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
"""

OPTIONAL = """
name: "identity_2_float32"
backend: "identity"
max_batch_size: 4
input [
  { name: "INPUT0", data_type: TYPE_FP32, dims: [ 2 ] },
  { name: "INPUT1", data_type: TYPE_FP32, dims: [ -1 ], optional: true }
]
output [
  { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 2 ] },
  { name: "OUTPUT1", data_type: TYPE_FP32, dims: [ -1 ] }
]
"""

UNPAIRED = """
name: "unpaired"
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 4 ] } ]
"""

ENSEMBLE = """
name: "nop_chain"
platform: "ensemble"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "identity_fp32", model_version: -1,
    input_map { key: "INPUT0" value: "INPUT0" } output_map { key: "OUTPUT0" value: "mid" } },
  { model_name: "identity_fp32", model_version: -1,
    input_map { key: "INPUT0" value: "mid" } output_map { key: "OUTPUT0" value: "OUTPUT0" } }
] }
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for text in (FP32, BYTES, OPTIONAL, UNPAIRED, ENSEMBLE):
        name = text.split('name: "', 1)[1].split('"', 1)[0]
        (tmp_path / name / "1").mkdir(parents=True)  # no model file: the config is all
        (tmp_path / name / "config.pbtxt").write_text(text)
    return tmp_path


def _input(name: str, arr: np.ndarray, datatype: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(arr.shape), datatype)
    tensor.set_data_from_numpy(arr, binary_data=True)
    return tensor


def test_identity_models_copy_their_inputs_and_fill_optional_ones(run_appliance, repo) -> None:
    srv = run_appliance(repo)
    client = httpclient.InferenceServerClient(srv.url)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    result = client.infer("identity_fp32", [_input("INPUT0", x, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
    words = np.array([b"caf\xc3\xa9", b"", b"\x00\xff"], dtype=object)
    result = client.infer("identity_bytes", [_input("INPUT0", words, "BYTES")])
    assert list(result.as_numpy("OUTPUT0")) == list(words)
    # the optional INPUT1 left out, OUTPUT1 asked for: zeros of its dims (-1 as 1)
    pair = np.ones((2, 2), dtype=np.float32)
    asked = [httpclient.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
    result = client.infer("identity_2_float32", [_input("INPUT0", pair, "FP32")], outputs=asked)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), pair)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((2, 1), np.float32))
    # and given, it is copied
    extra = np.full((2, 3), 7, dtype=np.float32)
    result = client.infer(
        "identity_2_float32",
        [_input("INPUT0", pair, "FP32"), _input("INPUT1", extra, "FP32")],
        outputs=asked,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), extra)
    # an ensemble of identity steps, as Triton's QA builds its nop ensembles
    result = client.infer("nop_chain", [_input("INPUT0", x, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)


def test_a_config_that_does_not_pair_its_tensors_fails_to_load_with_tritons_text(
    run_appliance, repo
) -> None:
    srv = run_appliance(repo)
    client = httpclient.InferenceServerClient(srv.url)
    assert not client.is_model_ready("unpaired")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert "expected input and output datatype to match, got FP32 and INT32" in index[
        "unpaired"
    ].get("reason", ""), index["unpaired"]
    with pytest.raises(InferenceServerException, match="unpaired"):
        client.infer("unpaired", [_input("INPUT0", np.zeros(4, np.float32), "FP32")])
