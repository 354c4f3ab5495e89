"""Model and server configuration: parsing, validation messages, auto-complete."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from appliance.backends.base import TensorSpec
from appliance.config.completion import complete
from appliance.config.fields import ConfigError, parse_size
from appliance.config.model_config import (
    DynamicBatching,
    InstanceGroup,
    ModelConfig,
    TensorConfig,
    VersionPolicy,
    parse_model_config,
)
from appliance.config.reader import load_model_config
from appliance.config.server_config import ServerConfig, load_server_config
from appliance.config.triton_config import to_triton_json
from appliance.errors import Code

SRC = "models/det/config.yaml"

FULL: dict[str, Any] = {
    "name": "det",
    "backend": "onnxruntime",
    "max_batch_size": 8,
    "input": [
        {"name": "images", "data_type": "TYPE_FP32", "dims": [3, -1, -1]},
        {"name": "scale", "data_type": "FP16", "dims": [1], "optional": True},
    ],
    "output": [{"name": "labels", "data_type": "TYPE_STRING", "dims": [-1]}],
    "dynamic_batching": {
        "preferred_batch_size": [4, 8],
        "max_queue_delay_microseconds": 500,
        "default_queue_policy": {
            "max_queue_size": 64,
            "default_timeout_microseconds": "100000",
            "allow_timeout_override": False,
            "timeout_action": "REJECT",
        },
    },
    "instance_group": [{"count": 2, "kind": "KIND_CPU"}, {"kind": "KIND_GPU", "gpus": [0]}],
    "version_policy": {"specific": {"versions": [1, 3]}},
    "default_model_filename": "det.onnx",
    "parameters": {"intra_op_threads": {"string_value": "2"}, "mode": "fast", "level": 3},
}


def config_error(data: Any, name: str = "det") -> str:
    with pytest.raises(ConfigError) as e:
        parse_model_config(data, name, SRC)
    assert e.value.code is Code.INVALID_ARG
    message = str(e.value)
    assert message.startswith(f"{SRC}: ")
    return message


# ---- parse_model_config -------------------------------------------------------------


def test_parse_full_config() -> None:
    cfg = parse_model_config(FULL, "det", SRC)
    assert cfg.name == "det" and cfg.backend == "onnxruntime" and cfg.source == SRC
    assert cfg.max_batch_size == 8 and cfg.batch_size == 8
    assert cfg.inputs == (
        TensorConfig("images", "FP32", (3, -1, -1)),
        TensorConfig("scale", "FP16", (1,), optional=True),
    )
    assert cfg.outputs == (TensorConfig("labels", "BYTES", (-1,)),)
    assert cfg.dynamic_batching == DynamicBatching(
        preferred_batch_size=(4, 8),
        max_queue_delay_us=500,
        max_queue_size=64,
        default_timeout_us=100000,
        allow_timeout_override=False,
    )
    assert cfg.instance_group == (InstanceGroup(2, "KIND_CPU"), InstanceGroup(1, "KIND_GPU"))
    assert cfg.instance_count == 3
    assert cfg.version_policy == VersionPolicy("specific", versions=(1, 3))
    assert cfg.default_model_filename == "det.onnx"
    assert cfg.parameters == {"intra_op_threads": "2", "mode": "fast", "level": "3"}


def test_parse_empty_config_gives_defaults() -> None:
    cfg = parse_model_config(None, "m", SRC)
    assert cfg.max_batch_size is None and cfg.inputs == () and cfg.outputs == ()
    assert cfg.dynamic_batching is None
    assert cfg.instance_group == (InstanceGroup(),)
    assert cfg.version_policy == VersionPolicy("latest", num_versions=1)


def test_empty_dynamic_batching_enables_it() -> None:
    cfg = parse_model_config({"dynamic_batching": None}, "m", SRC)
    assert cfg.dynamic_batching == DynamicBatching()
    assert parse_model_config({"dynamic_batching": {}}, "m", SRC).dynamic_batching == (
        DynamicBatching()
    )


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ({"latest": {"num_versions": 2}}, VersionPolicy("latest", num_versions=2)),
        ({"latest": {}}, VersionPolicy("latest", num_versions=1)),
        ({"latest": None}, VersionPolicy("latest", num_versions=1)),  # YAML's bare "latest:"
        ({"all": {}}, VersionPolicy("all")),
        ({"all": None}, VersionPolicy("all")),
        ({"specific": {"versions": [2]}}, VersionPolicy("specific", versions=(2,))),
    ],
)
def test_version_policies(policy: dict[str, Any], expected: VersionPolicy) -> None:
    assert parse_model_config({"version_policy": policy}, "m", SRC).version_policy == expected


def test_int64_as_string_is_accepted() -> None:
    assert parse_model_config({"max_batch_size": "4"}, "m", SRC).max_batch_size == 4


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {
                "input": [
                    {"name": "a", "data_type": "TYPE_FP32", "dims": [1]},
                    {"name": "b", "data_type": "TYPE_FP32", "dims": [3, "x"]},
                ]
            },
            "input[1].dims: expected a list of integers >= -1, got [3, 'x']",
        ),
        (
            {"input": [{"name": "a", "data_type": "TYPE_FP32", "dims": [-2]}]},
            "input[0].dims: expected a list of integers >= -1",
        ),
        (
            {"output": [{"name": "a", "data_type": "TYPE_FLOAT", "dims": [1]}]},
            "output[0].data_type: expected one of TYPE_BOOL",
        ),
        (
            {"output": [{"name": "", "data_type": "TYPE_FP32", "dims": [1]}]},
            "output[0].name: expected a non-empty tensor name",
        ),
        (
            {"input": [{"name": "a", "data_type": "TYPE_FP32", "dims": [1], "colour": "red"}]},
            "input[0].colour: unknown field",
        ),
        ({"input": {"name": "a"}}, "input: expected a list, got dict"),
        ({"input": ["a"]}, "input[0]: expected a mapping, got str"),
        (
            {"input": [{"name": "a", "data_type": "TYPE_FP32", "optional": "yes"}]},
            "input[0].optional: expected true or false, got 'yes'",
        ),
        (
            {"dynamic_batching": {"max_queue_delay_microseconds": -5}},
            "dynamic_batching.max_queue_delay_microseconds: expected an integer >= 0, got -5",
        ),
        (
            {"dynamic_batching": {"max_queue_delay_microseconds": 1.5}},
            "dynamic_batching.max_queue_delay_microseconds: expected an integer >= 0, got 1.5",
        ),
        (
            {"dynamic_batching": {"preferred_batch_size": [0]}},
            "dynamic_batching.preferred_batch_size: expected a list of integers >= 1",
        ),
        (
            {"dynamic_batching": {"default_queue_policy": {"timeout_action": "WAIT"}}},
            "dynamic_batching.default_queue_policy.timeout_action: expected REJECT or DELAY",
        ),
        (
            {"dynamic_batching": {"default_queue_policy": {"max_queue_size": True}}},
            "dynamic_batching.default_queue_policy.max_queue_size: expected an integer >= 0",
        ),
        ({"dynamic_batching": {"max_delay": 5}}, "dynamic_batching.max_delay: unknown field"),
        ({"dynamic_batching": [1]}, "dynamic_batching: expected a mapping, got list"),
        ({"max_batch_size": -3}, "max_batch_size: expected an integer >= 0, got -3"),
        ({"max_batch_size": True}, "max_batch_size: expected an integer >= 0, got True"),
        ({"colour": "red"}, "colour: unknown field, expected one of"),
        ({"name": "other"}, "name: expected 'det' (the model's folder name), got 'other'"),
        ({"backend": 3}, "backend: expected a string, got 3"),
        (
            {"instance_group": [{"kind": "KIND_TPU"}]},
            "instance_group[0].kind: expected KIND_CPU, KIND_GPU, KIND_AUTO or KIND_MODEL, "
            "got 'KIND_TPU'",
        ),
        (
            {"instance_group": [{"count": 1}, {"count": 0}]},
            "instance_group[1].count: expected an integer >= 1, got 0",
        ),
        (
            {"version_policy": {"latest": {}, "all": {}}},
            "version_policy: expected exactly one of latest, all, specific",
        ),
        ({"version_policy": {}}, "version_policy: expected exactly one of latest, all, specific"),
        ({"version_policy": {"newest": {}}}, "version_policy.newest: unknown field"),
        (
            {"version_policy": {"latest": {"num_versions": 0}}},
            "version_policy.latest.num_versions: expected an integer >= 1, got 0",
        ),
        (
            {"version_policy": {"specific": {"versions": []}}},
            "version_policy.specific.versions: expected at least one version number",
        ),
        ({"version_policy": {"specific": None}}, "version_policy.specific: expected a mapping"),
        ({"parameters": {"threads": [1, 2]}}, "parameters.threads: expected a string value"),
        ({"parameters": ["a"]}, "parameters: expected a mapping, got list"),
    ],
)
def test_invalid_model_config_names_the_field(data: dict[str, Any], expected: str) -> None:
    assert expected in config_error(data)


def test_config_must_be_a_mapping() -> None:
    assert config_error(["input"]) == f"{SRC}: expected a mapping, got list"


def test_unsupported_fields_warn_instead_of_failing(caplog: pytest.LogCaptureFixture) -> None:
    data = {
        "model_operations": {},
        "optimization": {},
        "input": [{"name": "a", "data_type": "TYPE_FP32", "dims": [1], "is_shape_tensor": False}],
        "output": [
            {"name": "p", "data_type": "TYPE_FP32", "dims": [10], "allow_ragged_batch": True}
        ],
    }
    with caplog.at_level(logging.WARNING, logger="appliance.config.model_config"):
        cfg = parse_model_config(data, "m", SRC)
    assert cfg.inputs[0].name == "a" and cfg.outputs[0].dims == (10,)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for field in ("model_operations", "optimization", "is_shape_tensor", "allow_ragged_batch"):
        assert any(SRC in w and field in w for w in warnings), field


# ---- load_model_config --------------------------------------------------------------


def test_load_model_config_from_yaml(tmp_path: Path) -> None:
    model_dir = tmp_path / "simple"
    model_dir.mkdir()
    (model_dir / "config.yaml").write_text(
        "backend: onnxruntime\nmax_batch_size: 4\ninput:\n"
        "  - {name: x, data_type: TYPE_INT32, dims: [16]}\n"
    )
    cfg = load_model_config(model_dir)
    assert cfg.name == "simple" and cfg.max_batch_size == 4
    assert cfg.inputs == (TensorConfig("x", "INT32", (16,)),)
    assert cfg.source == str(model_dir / "config.yaml")


def test_load_model_config_yml_and_missing(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.yml").write_text("max_batch_size: 2\n")
    assert load_model_config(tmp_path / "a").max_batch_size == 2
    (tmp_path / "b").mkdir()
    bare = load_model_config(tmp_path / "b")
    assert bare == ModelConfig(name="b", source=str(tmp_path / "b"))


def test_load_model_config_invalid_yaml_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "config.yaml"
    path.write_text("input: [\n  - name: x\n")
    with pytest.raises(ConfigError) as e:
        load_model_config(tmp_path / "m")
    assert str(e.value).startswith(f"{path}: not valid YAML")


def test_load_model_config_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "config.yaml"
    path.write_text("max_batch_size: -3\n")
    with pytest.raises(ConfigError) as e:
        load_model_config(tmp_path / "m")
    assert str(e.value) == f"{path}: max_batch_size: expected an integer >= 0, got -3"


# ---- complete -----------------------------------------------------------------------

IMAGES = TensorSpec("images", "FP32", (-1, 3, 224, 224))
PROBS = TensorSpec("probs", "FP32", (-1, 1000))


def bare(**fields: Any) -> ModelConfig:
    return ModelConfig(name="m", source=SRC, **fields)


def complete_error(config: ModelConfig, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> str:
    with pytest.raises(ConfigError) as e:
        complete(config, inputs, outputs, 8)
    assert e.value.code is Code.INVALID_ARG
    message = str(e.value)
    assert message.startswith(f"{SRC}: ")
    return message


def test_complete_dynamic_first_dim_enables_batching() -> None:
    cfg = complete(bare(), [IMAGES], [PROBS], 16)
    assert cfg.max_batch_size == 16
    assert cfg.inputs == (TensorConfig("images", "FP32", (3, 224, 224)),)
    assert cfg.outputs == (TensorConfig("probs", "FP32", (1000,)),)
    assert cfg.dynamic_batching == DynamicBatching()


def test_complete_fixed_first_dim_disables_batching() -> None:
    x = TensorSpec("x", "INT64", (1, 4))
    y = TensorSpec("y", "INT64", (-1, 4))
    cfg = complete(bare(), [x], [y], 16)
    assert cfg.max_batch_size == 0
    assert cfg.inputs == (TensorConfig("x", "INT64", (1, 4)),)
    assert cfg.outputs == (TensorConfig("y", "INT64", (-1, 4)),)
    assert cfg.dynamic_batching is None


def test_complete_explicit_max_batch_size_keeps_batching_off() -> None:
    cfg = complete(bare(max_batch_size=4), [IMAGES], [PROBS], 16)
    assert cfg.max_batch_size == 4
    assert cfg.dynamic_batching is None  # only auto-chosen batch sizes switch it on


def test_complete_explicit_zero_keeps_the_batch_dim() -> None:
    cfg = complete(bare(max_batch_size=0), [IMAGES], [PROBS], 16)
    assert cfg.max_batch_size == 0
    assert cfg.inputs[0].dims == (-1, 3, 224, 224)


def test_complete_checks_declared_tensors() -> None:
    declared = bare(inputs=(TensorConfig("images", "FP32", (3, -1, 224)),))
    cfg = complete(declared, [IMAGES], [PROBS], 8)
    assert cfg.inputs == declared.inputs  # -1 in the config matches any model size
    assert cfg.outputs == (TensorConfig("probs", "FP32", (1000,)),)


def test_complete_rejects_unknown_input() -> None:
    cfg = bare(inputs=(TensorConfig("image", "FP32", (3, 224, 224)),))
    msg = complete_error(cfg, [IMAGES], [PROBS])
    assert "input 'image': the model has no such input; it has ['images']" in msg


def test_complete_rejects_unknown_output() -> None:
    cfg = bare(outputs=(TensorConfig("logits", "FP32", (1000,)),))
    assert "output 'logits': the model has no such output" in complete_error(cfg, [IMAGES], [PROBS])


def test_complete_rejects_datatype_mismatch() -> None:
    cfg = bare(inputs=(TensorConfig("images", "FP16", (3, 224, 224)),))
    msg = complete_error(cfg, [IMAGES], [PROBS])
    assert "input 'images': config says FP16 but the model has FP32" in msg


def test_complete_rejects_dims_mismatch() -> None:
    cfg = bare(inputs=(TensorConfig("images", "FP32", (3, 224)),))
    msg = complete_error(cfg, [IMAGES], [PROBS])
    assert "config dims [-1, 3, 224] do not match the model's shape [-1, 3, 224, 224]" in msg
    cfg = bare(inputs=(TensorConfig("images", "FP32", (3, 224, 225)),))
    assert "do not match" in complete_error(cfg, [IMAGES], [PROBS])


def test_complete_rejects_batching_with_fixed_first_dim() -> None:
    x = TensorSpec("x", "FP32", (1, 4))
    declared = bare(max_batch_size=4, inputs=(TensorConfig("x", "FP32", (4,)),))
    msg = complete_error(declared, [x], [])
    assert "input 'x': max_batch_size > 0 needs a dynamic first dim" in msg
    # the same holds when the tensors themselves are auto-completed
    msg = complete_error(bare(max_batch_size=4), [x], [])
    assert "input 'x': max_batch_size > 0 needs a dynamic first dim" in msg


def test_complete_rejects_missing_model_input() -> None:
    mask = TensorSpec("mask", "BOOL", (-1, 224, 224))
    cfg = bare(inputs=(TensorConfig("images", "FP32", (3, 224, 224)),))
    msg = complete_error(cfg, [IMAGES, mask], [PROBS])
    assert "input: the model also needs inputs ['mask']" in msg


# ---- to_triton_json -----------------------------------------------------------------


def test_to_triton_json() -> None:
    cfg = parse_model_config(FULL, "det", SRC)
    out = to_triton_json(cfg)
    assert out["name"] == "det" and out["backend"] == "onnxruntime"
    assert out["max_batch_size"] == 8
    assert out["input"][0] == {
        "name": "images",
        "data_type": "TYPE_FP32",
        "format": "FORMAT_NONE",
        "dims": [3, -1, -1],
        "optional": False,
    }
    assert out["output"][0]["data_type"] == "TYPE_STRING"
    assert out["version_policy"] == {"specific": {"versions": [1, 3]}}
    assert out["instance_group"] == [
        {"name": "det_0", "kind": "KIND_CPU", "count": 2},
        {"name": "det_1", "kind": "KIND_GPU", "count": 1},
    ]
    assert out["parameters"]["intra_op_threads"] == {"string_value": "2"}
    assert out["dynamic_batching"] == {
        "preferred_batch_size": [4, 8],
        "max_queue_delay_microseconds": 500,
        "default_queue_policy": {
            "timeout_action": "REJECT",
            "default_timeout_microseconds": 100000,
            "allow_timeout_override": False,
            "max_queue_size": 64,
        },
    }


def test_to_triton_json_reparses() -> None:
    """Triton's JSON form is itself a valid config with the same meaning."""
    cfg = parse_model_config(FULL, "det", SRC)
    again = parse_model_config(to_triton_json(cfg), "det", SRC)
    assert again == cfg


def test_to_triton_json_defaults() -> None:
    out = to_triton_json(ModelConfig(name="m"))
    assert out["max_batch_size"] == 0 and "dynamic_batching" not in out
    assert out["version_policy"] == {"latest": {"num_versions": 1}}
    assert to_triton_json(ModelConfig("m", version_policy=VersionPolicy("all")))[
        "version_policy"
    ] == {"all": {}}


# ---- VersionPolicy ------------------------------------------------------------------


def test_version_policy_select() -> None:
    available = [1, 3, 2, 10]
    assert VersionPolicy().select(available) == [10]
    assert VersionPolicy("latest", num_versions=2).select(available) == [10, 3]
    assert VersionPolicy("all").select(available) == [10, 3, 2, 1]
    assert VersionPolicy("specific", versions=(2, 7, 1)).select(available) == [2, 1]
    assert VersionPolicy().select([]) == []


# ---- parse_size ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("64MiB", 64 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1024B", 1024),
        ("2 kib", 2048),
        ("100 bytes", 100),
        ("10kB", 10_000),
        ("1gib", 2**30),
        ("7b", 7),
    ],
)
def test_parse_size(value: Any, expected: int) -> None:
    assert parse_size(value, "appliance.yaml", "max_request_size") == expected


@pytest.mark.parametrize(
    "value", ["lots", "64MiBs", "-1MB", "0", 0, -5, True, "1.5.0GB", None, 100, "100"]
)
def test_parse_size_rejects(value: Any) -> None:
    with pytest.raises(ConfigError) as e:
        parse_size(value, "appliance.yaml", "max_request_size")
    assert str(e.value).startswith("appliance.yaml: max_request_size: expected a size such as")


# ---- load_server_config -------------------------------------------------------------


def test_server_config_defaults() -> None:
    assert load_server_config(None, {}) == ServerConfig()


def test_server_config_file_and_overrides(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    path = tmp_path / "appliance.yaml"
    path.write_text(
        "model_repository: models\nhttp_port: 9000\nmax_request_size: 1MiB\n"
        "drain_timeout_s: 2.5\nlog_level: DEBUG\ndefault_max_batch_size: 4\n"
    )
    cfg = load_server_config(path, {"http_port": 9100, "host": None})
    assert cfg.model_repository == tmp_path / "models"  # relative to the config file
    assert cfg.http_port == 9100  # the command line wins
    assert cfg.host == "127.0.0.1"  # None overrides are ignored
    assert cfg.max_request_size == 2**20
    assert cfg.drain_timeout_s == 2.5
    assert cfg.log_level == "debug"
    assert cfg.default_max_batch_size == 4


def test_server_config_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "appliance.yaml"
    path.write_text("")
    assert load_server_config(path, {}) == ServerConfig()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"http_port": "eighty"}, "http_port: expected an integer >= -1, got 'eighty'"),
        ({"metrics_port": -2}, "metrics_port: expected an integer >= -1, got -2"),
        ({"log_level": "loud"}, "log_level: expected debug, info, warning or error, got 'loud'"),
        ({"drain_timeout_s": -1}, "drain_timeout_s: expected a number of seconds >= 0, got -1"),
        ({"drain_timeout_s": "soon"}, "drain_timeout_s: expected a number of seconds >= 0"),
        ({"default_max_batch_size": 0}, "default_max_batch_size: expected an integer >= 1, got 0"),
        ({"default_max_queue_size": 0}, "default_max_queue_size: expected an integer >= 1, got 0"),
        ({"max_request_size": "big"}, "max_request_size: expected a size such as 64MiB"),
        ({"host": 127}, "host: expected a string, got 127"),
        ({"workers": 4}, "workers: unknown field, expected one of"),
        ({"grpc_max_connections": 0}, "grpc_max_connections: expected an integer >= 1, got 0"),
        (
            {"grpc_max_concurrent_streams": 2**31},
            "grpc_max_concurrent_streams: expected an integer from 1 to 2147483647",
        ),
        (
            {"grpc_max_header_list_size": "512B"},
            "grpc_max_header_list_size: expected a size from 1KiB to 1MiB, got 512 bytes",
        ),
        ({"grpc_max_header_list_size": 8192}, "grpc_max_header_list_size: expected a size"),
        ({"grpc_idle_timeout_s": 0}, "grpc_idle_timeout_s: expected a number of seconds >= 0.01"),
        ({"grpc_read_timeout_s": "x"}, "grpc_read_timeout_s: expected a number of seconds"),
    ],
)
def test_server_config_bad_values_name_the_field(options: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_server_config(None, options)
    assert str(e.value).startswith(f"<command line>: {expected}")


def test_server_config_bad_value_in_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "appliance.yaml"
    path.write_text("http_port: -2\n")
    with pytest.raises(ConfigError) as e:
        load_server_config(path, {})
    assert str(e.value) == f"{path}: http_port: expected an integer >= -1, got -2"


def test_server_config_model_repository_not_a_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError) as e:
        load_server_config(None, {"model_repository": str(missing)})
    assert f"model_repository: expected a directory, {str(missing)!r} is not one" in str(e.value)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError):
        load_server_config(None, {"model_repository": a_file})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http_port: [\n", "not valid YAML"),
        ("- http_port: 1\n", "expected a mapping, got list"),
        ("just a string\n", "expected a mapping, got str"),
    ],
)
def test_server_config_bad_file(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "appliance.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_server_config(path, {})
    assert str(e.value).startswith(f"{path}: {expected}")


def test_server_config_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_server_config(tmp_path / "missing.yaml", {})
    assert str(e.value).startswith(f"{tmp_path / 'missing.yaml'}: cannot read")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError) as e:
        load_server_config(binary, {})
    assert str(e.value).startswith(f"{binary}: not valid YAML")


@pytest.mark.parametrize("value", [60, "60", " 1.5 "])
def test_a_size_without_a_unit_says_so(value: Any) -> None:
    # `memory_limit: 60` once meant 60 bytes without a word
    with pytest.raises(ConfigError, match=r"a size needs a unit \(.*MiB, .*MB, or .*B for bytes\)"):
        parse_size(value, "appliance.yaml", "memory_limit")
