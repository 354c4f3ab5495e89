"""Triton repositories as they are: config.pbtxt read by protobuf against Triton's
ModelConfig schema, validated like YAML, and the config endpoint in Triton's JSON."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from appliance.config.fields import ConfigError
from appliance.config.model_config import parse_model_config
from appliance.config.reader import load_model_config
from appliance.config.triton_config import json_to_dict, pbtxt_to_dict
from devtools import modelgen

SIMPLE_PBTXT = """
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
default_model_filename: "simple.onnx"
version_policy: { specific: { versions: [ 1, 3 ] } }
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
}
model_warmup [
  {
    name: "zeros_and_ones"
    batch_size: 2
    inputs { key: "INPUT0" value: { data_type: TYPE_INT32 dims: [ 16 ] zero_data: true } }
    inputs { key: "INPUT1" value: { data_type: TYPE_INT32 dims: [ 16 ] input_data_file: "ones" } }
  }
]
optimization { input_pinned_memory { enable: true } }
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
"""


def _triton_repository(repo: Path) -> Path:
    """A repository laid out for Triton: pbtxt, custom file name, three versions of
    which the policy serves two, warm-up data in warmup/."""
    folder = repo / "simple"
    for v in (1, 2, 3):
        (folder / str(v)).mkdir(parents=True)
        (folder / str(v) / "simple.onnx").write_bytes(modelgen.simple_add_sub())
    (folder / "config.pbtxt").write_text(SIMPLE_PBTXT)
    (folder / "warmup").mkdir()
    (folder / "warmup" / "ones").write_bytes(np.ones(16, np.int32).tobytes())
    # Triton's "max_batch_size: 0" form: the dims are the whole shape
    whole = modelgen.write_model(repo, "whole", modelgen.identity("FP32", [-1]))
    (whole / "config.pbtxt").write_text(
        'max_batch_size: 0\ninput [{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1, -1 ] }]\n'
        'output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1, -1 ] }]\n'
    )
    return repo


def _inputs(rows: int = 1) -> list[httpclient.InferInput]:
    inputs = [httpclient.InferInput(n, [rows, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(np.arange(16 * rows, dtype=np.int32).reshape(rows, 16))
    inputs[1].set_data_from_numpy(np.ones((rows, 16), np.int32))
    return inputs


def test_a_triton_repository_loads_unchanged(
    run_appliance, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="appliance.config.model_config"):
        srv = run_appliance(_triton_repository(tmp_path))
    client = httpclient.InferenceServerClient(srv.url)
    index = client.get_model_repository_index()
    assert [(r["name"], r.get("version"), r["state"]) for r in index] == [
        ("simple", "1", "READY"),
        ("simple", "3", "READY"),
        ("whole", "1", "READY"),
    ]
    result = client.infer("simple", _inputs(2))
    assert result.get_response()["model_version"] == "3"  # the newest the policy serves
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(32).reshape(2, 16) + 1)
    assert client.infer("simple", _inputs(), model_version="1").as_numpy("OUTPUT1").shape == (1, 16)
    with pytest.raises(InferenceServerException, match="version 2 is not found"):
        client.infer("simple", _inputs(), model_version="2")
    # unsupported fields are named in a warning, never silently dropped
    assert any(
        "config.pbtxt: field 'optimization' is not supported" in r.getMessage()
        for r in caplog.records
    )

    config = client.get_model_config("simple")
    # Triton's JSON form: protobuf itself accepts it against the ModelConfig schema
    message = json_format.ParseDict(config, model_config_pb2.ModelConfig())
    assert message.platform == "onnxruntime_onnx" and message.backend == "onnxruntime"
    assert message.max_batch_size == 8 and message.default_model_filename == "simple.onnx"
    assert list(message.version_policy.specific.versions) == [1, 3]
    assert list(message.dynamic_batching.preferred_batch_size) == [4, 8]
    assert message.dynamic_batching.max_queue_delay_microseconds == 100
    cpu = model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert [(g.count, g.kind) for g in message.instance_group] == [(2, cpu)]
    [warm] = message.model_warmup
    assert (warm.name, warm.batch_size) == ("zeros_and_ones", 2)
    assert warm.inputs["INPUT1"].input_data_file == "ones"
    assert message.parameters["intra_op_thread_count"].string_value == "1"
    assert config["input"][0]["dims"] == [16]  # numbers, as Triton writes them

    whole = client.get_model_metadata("whole")
    assert whole["inputs"][0]["shape"] == [-1, -1]
    assert client.get_model_config("whole")["max_batch_size"] == 0
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    inp = httpclient.InferInput("INPUT0", [2, 3], "FP32")
    inp.set_data_from_numpy(data)
    np.testing.assert_array_equal(client.infer("whole", [inp]).as_numpy("OUTPUT0"), data)

    # gRPC's ModelConfig carries the same message
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    assert grpc.get_model_config("simple").config == message


def test_pbtxt_values_reach_the_validator_as_yaml_would() -> None:
    data = pbtxt_to_dict(SIMPLE_PBTXT, "simple/config.pbtxt")
    assert data["version_policy"] == {"specific": {"versions": ["1", "3"]}}  # int64: strings
    cfg = parse_model_config(data, "simple", "simple/config.pbtxt")
    assert cfg.version_policy.versions == (1, 3) and cfg.inputs[0].dims == (16,)
    assert cfg.max_batch_size == 8 and cfg.instance_group[0].count == 2
    warm = {i.name: i for i in cfg.model_warmup[0].inputs}
    assert warm["INPUT1"].file == "ones" and warm["INPUT0"].data == "zero"
    assert cfg.model_warmup[0].batch_size == 2
    assert cfg.dynamic_batching is not None and cfg.dynamic_batching.max_queue_delay_us == 100


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max_batch_size: 8\ninput [{ name: 'x' ", "not a valid Triton model config: 2:"),
        ("max_batch: 8\n", 'has no field named "max_batch"'),
        ("max_batch_size: -1\n", "max_batch_size: expected an integer >= 0, got -1"),
        (
            "max_batch_size: 4\ndynamic_batching { preferred_batch_size: [ 8 ] }\n",
            "dynamic_batching.preferred_batch_size: [8] exceed max_batch_size 4",
        ),
        ("input [{ name: 'x' data_type: TYPE_NOPE }]\n", "TYPE_NOPE"),
        (
            'name: "other"\n',
            "name: expected 'm' (the model's folder name), got 'other'",
        ),
    ],
)
def test_bad_pbtxt_names_the_file_and_what_is_wrong(
    tmp_path: Path, text: str, expected: str
) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.pbtxt").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_model_config(folder)
    assert str(info.value).startswith(f"{folder / 'config.pbtxt'}: ")
    assert expected in str(info.value)


def test_two_config_files_are_refused(tmp_path: Path) -> None:
    folder = modelgen.write_model(tmp_path, "m", modelgen.simple_add_sub(), "max_batch_size: 8\n")
    (folder / "config.pbtxt").write_text("max_batch_size: 8\n")
    with pytest.raises(
        ConfigError, match=r"found config\.yaml and config\.pbtxt: keep exactly one"
    ):
        load_model_config(folder)


def test_json_config_override_uses_the_same_schema() -> None:
    doc = json_to_dict('{"maxBatchSize": 4, "input": [{"name": "a", "dims": ["2"]}]}', "req")
    assert doc == {"max_batch_size": 4, "input": [{"name": "a", "dims": ["2"]}]}
    with pytest.raises(ConfigError, match=r"^req: not a valid Triton model config"):
        json_to_dict('{"max_batch_size": "four"}', "req")


def test_a_bad_pbtxt_makes_only_its_model_unavailable(run_appliance, tmp_path: Path) -> None:
    _triton_repository(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "whole", broken)
    (broken / "config.pbtxt").write_text("max_batch_size: [ 1 ]\n")
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url)
    rows = {r["name"]: r for r in client.get_model_repository_index()}
    assert rows["broken"]["state"] == "UNAVAILABLE"
    assert "broken/config.pbtxt: not a valid Triton model config" in rows["broken"]["reason"]
    assert client.infer("simple", _inputs()).as_numpy("OUTPUT0").shape == (1, 16)
