"""Attack class: names that try to leave the model repository.

Model names, versions and the file names a config gives are tried over every way
they arrive (HTTP path, gRPC fields, MQTT topics, load ``config`` overrides,
ensemble steps, repository files) with traversal, encoded separators, absolute
paths, NUL and control characters, leading dots and Unicode look-alikes; and
symbolic links out of the repository. Every one must be refused with a precise
error, and nothing outside the repository may ever be loaded: the planted
``model.py`` outside writes a marker file the moment it is imported.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from appliance import names
from appliance.adapters.mqtt.protocol import Topics
from appliance.config.fields import ConfigError
from appliance.config.model_config import parse_model_config
from appliance.errors import ApplianceError, Code
from devtools import modelgen

EVIL_PY = """
import pathlib
pathlib.Path(__file__).with_name("PWNED").write_text("this code ran inside the server")


class TritonPythonModel:
    def initialize(self, args):
        pass

    def execute(self, requests):
        return []
"""
EVIL_CONFIG = """
backend: python
max_batch_size: 0
input: [{name: IN, data_type: TYPE_FP32, dims: [1]}]
output: [{name: OUT, data_type: TYPE_FP32, dims: [1]}]
"""

# names no model may have, whatever transport carries them
BAD_NAMES = [
    pytest.param("simple/../../evil", id="traversal"),
    pytest.param("../evil", id="parent"),
    pytest.param("..", id="dotdot"),
    pytest.param(".", id="dot"),
    pytest.param(".hidden", id="leading-dot"),
    pytest.param("...", id="three-dots"),
    pytest.param("/etc", id="absolute"),
    pytest.param("simple\\..\\..\\evil", id="backslash"),
    pytest.param("a/b", id="slash"),
    pytest.param("evil\x00.onnx", id="nul"),
    pytest.param("a\nb", id="newline"),
    pytest.param("a\x1bb", id="escape"),
    pytest.param("\u202eevil", id="bidi-override"),
    pytest.param("evil\u200b", id="zero-width"),
    pytest.param("\uff0e\uff0e", id="fullwidth-dots"),
    pytest.param("\u2025", id="two-dot-leader"),
    pytest.param("a\uff0fb", id="fullwidth-solidus"),
    pytest.param("a\u2215b", id="division-slash"),
    pytest.param("a\ufe68b", id="small-reverse-solidus"),
    pytest.param(" simple", id="leading-space"),
    pytest.param("simple ", id="trailing-space"),
    pytest.param("", id="empty"),
    pytest.param("x" * 256, id="too-long"),
    pytest.param("\u00e9" * 128, id="too-long-utf8"),
]
GOOD_NAMES = ["simple", "densenet_onnx", "model-v2", "a.b", "x" * 255, "r\u00e9seau", "1"]
BAD_VERSIONS = [
    "\u00b2",
    "\uff11",
    "1.0",
    "-1",
    "0",
    "+1",
    " 1",
    "1 ",
    "99999999999999999999",
    "9223372036854775808",
    "..",
    "1/../2",
    "0x10",
]


def _evil(tmp_path: Path) -> Path:
    """A Python model outside the repository that leaves a marker when imported."""
    evil = tmp_path / "evil"
    (evil / "1").mkdir(parents=True)
    (evil / "1" / "model.py").write_text(EVIL_PY)
    (evil / "config.yaml").write_text(EVIL_CONFIG)
    return evil


def _repository(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    modelgen.write_model(repo, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
    return repo


def _marker(evil: Path) -> Path:
    return evil / "1" / "PWNED"


def _http(
    url: str, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    return status, json.loads(raw) if raw else None


# ---- the rule itself ----------------------------------------------------------------


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_model_names_are_refused(name: str) -> None:
    assert names.name_problem(name)
    with pytest.raises(ApplianceError) as info:
        names.check_model_name(name)
    assert info.value.code is Code.INVALID_ARG and "invalid model name" in info.value.message
    assert len(info.value.message) < 400  # a long name is not echoed back whole


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_model_names_pass(name: str) -> None:
    assert names.check_model_name(name) == name


@pytest.mark.parametrize("version", BAD_VERSIONS)
def test_bad_versions_are_refused(version: str) -> None:
    with pytest.raises(ApplianceError) as info:
        names.check_version(version)
    assert info.value.code is Code.INVALID_ARG
    assert names.version_folder(version) is None


def test_good_versions_pass() -> None:
    assert [names.check_version(v) for v in ("", "1", "007", "9223372036854775807")] == [
        "",
        "1",
        "007",
        "9223372036854775807",
    ]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_the_hot_path_pair_check_refuses_what_the_rule_refuses(name: str) -> None:
    # asked twice: a refusal is never remembered as a pass
    for _ in range(2):
        with pytest.raises(ApplianceError) as info:
            names.check_model_and_version(name, "")
        assert info.value.code is Code.INVALID_ARG
    with pytest.raises(ApplianceError):
        names.check_model_and_version("simple", "1/../2")


@pytest.mark.parametrize("odd", [None, 3, ["simple"], {"a": 1}, b"simple"])
def test_the_pair_check_refuses_values_that_are_not_strings(odd: Any) -> None:
    for name, version in ((odd, ""), ("simple", odd)):
        with pytest.raises(ApplianceError) as info:  # INVALID_ARG, never a TypeError
            names.check_model_and_version(name, version)
        assert info.value.code is Code.INVALID_ARG


def test_the_pair_check_remembers_a_bounded_number_of_good_pairs() -> None:
    for i in range(names._GOOD_PAIRS_MAX + 10):
        assert names.check_model_and_version(f"m{i}", "1") == (f"m{i}", "1")
    assert 0 < len(names._GOOD_PAIRS) <= names._GOOD_PAIRS_MAX


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_in_mqtt_topics_are_refused(name: str) -> None:
    topics = Topics("appliance", "dev", shared_group="g")
    if "/" in name or not name:
        return  # a '/' makes another topic level, refused below; empty: an empty level
    for topic in (f"appliance/dev/infer/{name}", f"appliance/infer/{name}/1"):
        with pytest.raises(ApplianceError, match="invalid model name"):
            topics.parse(topic)


def test_bad_mqtt_topic_shapes_and_versions_are_refused() -> None:
    topics = Topics("appliance", "dev")
    assert topics.parse("appliance/dev/infer/simple/2").version == "2"
    for topic in (
        "appliance/dev/infer/simple/../evil",
        "appliance/dev/infer//evil",
        "appliance/dev/infer/a/b/c",
    ):
        with pytest.raises(ApplianceError, match=r"expected \.\.\./infer/<model>"):
            topics.parse(topic)
    for version in ("\u00b2", "0", "1.0", ".."):
        with pytest.raises(ApplianceError, match="invalid model version"):
            topics.parse(f"appliance/dev/infer/simple/{version}")


@pytest.mark.parametrize(
    ("key", "where"),
    [
        ("default_model_filename", None),
        ("label_filename", "output"),
        ("input_data_file", "warmup"),
        ("model_name", "ensemble"),
    ],
)
@pytest.mark.parametrize(
    "value",
    [
        "../../evil/1/model.py",
        "/etc/passwd",
        "..",
        ".hidden",
        "a/b",
        "a\x00b",
        "\uff0e\uff0e\uff0fx",
    ],
)
def test_file_and_step_names_in_configs_are_one_component(
    key: str, where: str | None, value: str
) -> None:
    tensor = {"name": "x", "data_type": "TYPE_FP32", "dims": [1]}
    doc: dict[str, Any] = {"backend": "onnxruntime", "input": [tensor], "output": [tensor]}
    if where is None:
        doc[key] = value
    elif where == "output":
        doc["output"] = [{**tensor, key: value}]
    elif where == "warmup":
        doc["model_warmup"] = [
            {"name": "w", "inputs": {"x": {"data_type": "TYPE_FP32", "dims": [1], key: value}}}
        ]
    else:
        doc = {
            "platform": "ensemble",
            "max_batch_size": 0,
            "input": [tensor],
            "output": [tensor],
            "ensemble_scheduling": {
                "step": [{key: value, "input_map": {"x": "x"}, "output_map": {"x": "x"}}]
            },
        }
    with pytest.raises(ConfigError, match="one path component"):
        parse_model_config(doc, "m", "m/config.yaml")


# ---- end to end: HTTP, gRPC -----------------------------------------------------------


def _http_names(evil: Path) -> list[tuple[str, str]]:
    """(label, path segment as sent) of names that try to reach ``evil``."""
    plain = [
        ("traversal-%2f", "simple%2f..%2f..%2fevil"),
        ("traversal-%2F", "simple%2F..%2F..%2Fevil"),
        ("absolute", urllib.parse.quote(str(evil), safe="")),
        ("backslash", "simple%5c..%5c..%5cevil"),
        ("nul", "evil%00"),
        ("leading-dot", ".hidden"),
        ("encoded-dotdot", "%2e%2e"),
        ("fullwidth", urllib.parse.quote("\uff0e\uff0e\uff0fevil", safe="")),
        ("double-encoded", "simple%252f..%252f..%252fevil"),
    ]
    return plain


def test_http_never_loads_or_serves_a_model_outside_the_repository(
    run_appliance: Any, tmp_path: Path
) -> None:
    evil = _evil(tmp_path)
    srv = run_appliance(_repository(tmp_path), model_control_mode="explicit", load_model=["simple"])
    base = f"http://{srv.url}/v2"
    for label, segment in _http_names(evil):
        status, body = _http(f"{base}/repository/models/{segment}/load", "POST", b"")
        assert status in (400, 404), (label, status, body)
        assert isinstance(body, dict) and body["error"], (label, body)
        if "%2f" in segment.lower() or label == "absolute":
            assert status == 400 and "invalid model name" in body["error"], (label, body)
        for tail in ("", "/ready", "/config", "/stats", "/versions/1", "/versions/1/config"):
            status, body = _http(f"{base}/models/{segment}{tail}")
            assert status in (400, 404), (label, tail, status)
            assert isinstance(body, dict) and body["error"], (label, tail, body)
        status, body = _http(f"{base}/models/{segment}/infer", "POST", b'{"inputs": []}')
        assert status in (400, 404) and body["error"], (label, status, body)
        status, body = _http(f"{base}/repository/models/{segment}/unload", "POST", b"")
        assert status in (400, 404) and body["error"], (label, status, body)
    assert not _marker(evil).exists()
    status, rows = _http(f"{base}/repository/index", "POST", b"{}")
    assert status == 200 and {r["name"] for r in rows} == {"simple"}


def test_an_admin_token_does_not_open_other_directories(run_appliance: Any, tmp_path: Path) -> None:
    evil = _evil(tmp_path)
    srv = run_appliance(_repository(tmp_path), admin_token="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    for segment in ("simple%2f..%2f..%2fevil", urllib.parse.quote(str(evil), safe="")):
        url = f"http://{srv.url}/v2/repository/models/{segment}/load"
        status, body = _http(url, "POST", b"", auth)
        assert status == 400 and "invalid model name" in body["error"]
    assert not _marker(evil).exists()


@pytest.mark.parametrize("version", BAD_VERSIONS[:6])
def test_http_versions_are_numbers(run_appliance: Any, tmp_path: Path, version: str) -> None:
    srv = run_appliance(_repository(tmp_path))
    segment = urllib.parse.quote(version, safe="")
    for tail in ("", "/ready", "/config", "/stats"):
        status, body = _http(f"http://{srv.url}/v2/models/simple/versions/{segment}{tail}")
        assert status == 400 and "invalid model version" in body["error"], (tail, body)


def test_grpc_refuses_every_bad_name(run_appliance: Any, tmp_path: Path) -> None:
    evil = _evil(tmp_path)
    srv = run_appliance(_repository(tmp_path))
    bad = [p.values[0] for p in BAD_NAMES] + [str(evil)]
    with grpc.insecure_channel(srv.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls = {
            "load": lambda n: stub.RepositoryModelLoad(
                service_pb2.RepositoryModelLoadRequest(model_name=n)
            ),
            "unload": lambda n: stub.RepositoryModelUnload(
                service_pb2.RepositoryModelUnloadRequest(model_name=n)
            ),
            "metadata": lambda n: stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=n)),
            "ready": lambda n: stub.ModelReady(service_pb2.ModelReadyRequest(name=n)),
            "config": lambda n: stub.ModelConfig(service_pb2.ModelConfigRequest(name=n)),
            "stats": lambda n: stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=n)),
            "infer": lambda n: stub.ModelInfer(service_pb2.ModelInferRequest(model_name=n)),
        }
        for name in bad:
            if not name:
                continue  # an empty name means "all models" in statistics; load: below
            for label, call in calls.items():
                with pytest.raises(grpc.RpcError) as info:
                    call(name)
                error: Any = info.value
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (label, name)
                assert "invalid model name" in error.details(), (label, name)
        with pytest.raises(grpc.RpcError) as info:
            calls["load"]("")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="simple", version="\u00b2"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert not _marker(evil).exists()


def test_load_config_override_cannot_name_files_outside(run_appliance: Any, tmp_path: Path) -> None:
    evil = _evil(tmp_path)
    srv = run_appliance(_repository(tmp_path))
    url = f"http://{srv.url}/v2/repository/models/simple/load"
    tensor = {"name": "IN", "data_type": "TYPE_FP32", "dims": [1]}
    python = {
        "backend": "python",
        "max_batch_size": 0,
        "input": [tensor],
        "output": [{**tensor, "name": "OUT"}],
    }
    for override in (
        {**python, "default_model_filename": "../../../evil/1/model.py"},
        {**python, "default_model_filename": str(evil / "1" / "model.py")},
        {**python, "name": "../evil"},
    ):
        doc = {"parameters": {"config": json.dumps(override)}}
        status, body = _http(url, "POST", json.dumps(doc).encode())
        assert status == 400 and body["error"], (override, body)
    assert not _marker(evil).exists()
    # the model that served before still serves
    assert _http(f"http://{srv.url}/v2/models/simple/ready")[0] == 200


# ---- symbolic links -------------------------------------------------------------------


def _index(srv: Any) -> dict[str, dict[str, Any]]:
    status, rows = _http(f"http://{srv.url}/v2/repository/index", "POST", b"{}")
    assert status == 200
    return {r["name"]: r for r in rows}


def test_a_model_folder_linked_outside_is_refused(run_appliance: Any, tmp_path: Path) -> None:
    evil = _evil(tmp_path)
    repo = _repository(tmp_path)
    os.symlink(evil, repo / "linked")
    srv = run_appliance(repo)
    row = _index(srv)["linked"]
    assert row["state"] == "UNAVAILABLE" and "symbolic link" in row["reason"]
    status, body = _http(f"http://{srv.url}/v2/repository/models/linked/load", "POST", b"")
    assert status == 400 and "symbolic link" in body["error"]
    assert not _marker(evil).exists()
    assert _http(f"http://{srv.url}/v2/models/simple/ready")[0] == 200


def test_links_out_of_version_folders_files_and_warmup_are_refused(
    run_appliance: Any, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.onnx").write_bytes(modelgen.simple_add_sub())
    (outside / "1").mkdir()
    (outside / "1" / "model.onnx").write_bytes(modelgen.simple_add_sub())
    (outside / "data.bin").write_bytes(b"\0" * 64)
    repo = _repository(tmp_path)
    config = modelgen.SIMPLE_CONFIG
    (repo / "file_link" / "1").mkdir(parents=True)
    os.symlink(outside / "model.onnx", repo / "file_link" / "1" / "model.onnx")
    (repo / "file_link" / "config.yaml").write_text(config)
    (repo / "version_link").mkdir()
    os.symlink(outside / "1", repo / "version_link" / "1")
    (repo / "version_link" / "config.yaml").write_text(config)
    warm = modelgen.write_model(
        repo,
        "warmup_link",
        modelgen.simple_add_sub(),
        config + "model_warmup: [{name: w, batch_size: 1, inputs: {"
        "INPUT0: {data_type: TYPE_INT32, dims: [16], input_data_file: data.bin}, "
        "INPUT1: {data_type: TYPE_INT32, dims: [16], zero_data: true}}}]\n",
    )
    (warm / "warmup").mkdir()
    os.symlink(outside / "data.bin", warm / "warmup" / "data.bin")
    # a link that stays inside the repository is fine
    (repo / "inside_link" / "1").mkdir(parents=True)
    os.symlink(repo / "simple" / "1" / "model.onnx", repo / "inside_link" / "1" / "model.onnx")
    (repo / "inside_link" / "config.yaml").write_text(config)
    srv = run_appliance(repo)
    rows = _index(srv)
    for name in ("file_link", "version_link", "warmup_link"):
        assert rows[name]["state"] == "UNAVAILABLE", rows[name]
        assert "symbolic link" in rows[name]["reason"], rows[name]
    assert rows["inside_link"]["state"] == "READY"


def test_the_operator_may_allow_linked_models(run_appliance: Any, tmp_path: Path) -> None:
    outside = modelgen.write_model(
        tmp_path / "elsewhere", "shared", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG
    )
    repo = _repository(tmp_path)
    os.symlink(outside, repo / "linked")
    srv = run_appliance(repo, allow_symlinked_models=True)
    assert _index(srv)["linked"]["state"] == "READY"
    assert _http(f"http://{srv.url}/v2/models/linked/ready")[0] == 200
    # trusting links does not make a request's name a path
    status, body = _http(
        f"http://{srv.url}/v2/repository/models/linked%2f..%2f..%2felsewhere%2fshared/load",
        "POST",
        b"",
    )
    assert status == 400 and "invalid model name" in body["error"]
