"""Model lifecycle: control modes, polling, Triton's states, warm-up, version policy and
bad input, against real servers (and the poll decisions as a pure function)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from http_helpers import post_json
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from appliance.config.fields import ConfigError
from appliance.core.repository import RepositoryPoller
from devtools import modelgen


def _simple_inputs() -> list[httpclient.InferInput]:
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(np.ones((1, 16), np.int32))
    return inputs


def _serves(client: httpclient.InferenceServerClient, model: str = "simple") -> str:
    result = client.infer(model, _simple_inputs())
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2))
    return str(result.get_response()["model_version"])


def _rows(client: httpclient.InferenceServerClient, name: str) -> list[tuple[Any, ...]]:
    return [
        (r.get("version"), r.get("state"))
        for r in client.get_model_repository_index()
        if r["name"] == name
    ]


def _unknown(client: httpclient.InferenceServerClient, model: str) -> bool:
    try:
        client.get_model_metadata(model)
    except InferenceServerException as exc:
        # "is not found": a model still listed but not ready answers "unknown model: 'x'
        # has no available versions" too, and is not gone yet
        return "is not found" in str(exc)
    return False


def _until(condition: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _matmul_4() -> bytes:
    """FP32 "x" [batch, n] @ a 4x4 weight: declared dynamic, so only n == 4 runs."""
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], [1.0] * 16)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()  # type: ignore[no-any-return]


# ---- control modes ----------------------------------------------------------------------


def test_mode_none_loads_everything_and_refuses_changes(run_appliance, tmp_path: Path) -> None:
    modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    srv = run_appliance(tmp_path, model_control_mode="none")
    client = httpclient.InferenceServerClient(srv.url)
    assert _serves(client) == "1"
    for call in (client.load_model, client.unload_model):
        with pytest.raises(InferenceServerException, match=r"model_control_mode: none") as info:
            call("simple")
        assert info.value.status() == "503"  # Triton: UNAVAILABLE
    assert _serves(client) == "1"


def test_mode_explicit_loads_only_what_is_asked(run_appliance, tmp_path: Path) -> None:
    modelgen.write_demo_repository(tmp_path)
    srv = run_appliance(tmp_path, model_control_mode="explicit", load_model=["simple"])
    client = httpclient.InferenceServerClient(srv.url)
    assert client.get_model_repository_index() == [
        {"name": "classifier"},
        {"name": "image_classifier"},
        {"name": "postprocess"},
        {"name": "preprocess"},
        {"name": "simple", "version": "1", "state": "READY", "reason": ""},
    ]
    assert client.is_server_ready()  # ready: every model it was asked to load is
    with pytest.raises(InferenceServerException, match="unknown model: 'classifier' is not found"):
        client.get_model_metadata("classifier")
    client.load_model("classifier")
    assert client.is_model_ready("classifier")
    client.unload_model("classifier")
    assert client.is_server_ready()  # an unloaded model is not expected to be ready


def test_explicit_start_with_a_model_the_repository_lacks_fails(
    run_appliance, tmp_path: Path
) -> None:
    modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    with pytest.raises(ConfigError, match=r"load_model: no such model\(s\) in .*\['nope'\]"):
        run_appliance(tmp_path, load_model=["simple", "nope"])


def test_poll_mode_follows_the_repository(run_appliance, tmp_path: Path) -> None:
    folder = modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    srv = run_appliance(tmp_path, model_control_mode="poll", repository_poll_secs=0.05)
    client = httpclient.InferenceServerClient(srv.url)
    with pytest.raises(InferenceServerException, match="the repository is polled") as refused:
        client.load_model("simple")
    # Triton's status and text first (python_http_aio_test, python_grpc_aio_test)
    assert refused.value.status() == "503"
    assert str(refused.value.message()).startswith(
        "explicit model load / unload is not allowed if polling is enabled"
    )

    (folder / "2").mkdir()  # a version folder still empty: being written, not acted on
    time.sleep(0.5)  # ten polls
    assert _rows(client, "simple") == [("1", "READY")]
    (folder / "2" / "model.onnx").write_bytes(modelgen.simple_add_sub())
    _until(lambda: _rows(client, "simple") == [("2", "READY")])
    assert _serves(client) == "2"

    added = modelgen.write_model(tmp_path, "added", modelgen.simple_add_sub())
    _until(lambda: _rows(client, "added") == [("1", "READY")])
    assert _serves(client, "added") == "1"
    shutil.rmtree(added)
    # not ready at once; unknown once its copy has drained and unloaded
    _until(lambda: not client.is_model_ready("added"))
    _until(lambda: _unknown(client, "added"))
    assert _rows(client, "added") == []
    with pytest.raises(InferenceServerException, match="unknown model: 'added' is not found"):
        _serves(client, "added")

    # a broken change is reported and the copy serving keeps serving
    (folder / "config.yaml").write_text("max_batch_size: [oops]\n")
    time.sleep(0.5)
    assert _serves(client) == "2"
    (folder / "config.yaml").write_text("max_batch_size: 4\n")
    _until(lambda: client.get_model_config("simple")["max_batch_size"] == 4)
    assert client.is_server_ready()


def test_the_poller_waits_until_a_change_holds_still() -> None:
    one = (("1/model.onnx", 100, 1),)
    growing = (("1/model.onnx", 100, 1), ("2/model.onnx", 10, 2))
    grown = (("1/model.onnx", 100, 1), ("2/model.onnx", 50, 3))
    poller = RepositoryPoller({"m": one})
    assert poller.changes({"m": one}) == ([], [])
    assert poller.changes({"m": growing}) == ([], [])  # just changed: maybe still written
    assert poller.changes({"m": grown}) == ([], [])  # changed again
    assert poller.changes({"m": None}) == ([], [])  # an empty version folder appeared
    assert poller.changes({"m": grown}) == ([], [])
    assert poller.changes({"m": grown}) == (["m"], [])  # the same twice: apply it
    poller.applied("m", grown)
    assert poller.changes({"m": grown}) == ([], [])  # applied once, not again
    assert poller.changes({}) == ([], [])  # gone once: maybe a rename in progress
    assert poller.changes({}) == ([], ["m"])  # gone twice: unload it
    poller.forget("m")
    assert poller.changes({}) == ([], [])


# ---- states, warm-up, unloading mid-load ------------------------------------------------


def test_a_model_is_loading_until_its_warm_up_ran(run_appliance, tmp_path: Path) -> None:
    modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    slow = modelgen.CLASSIFIER_CONFIG + (
        "model_warmup: [{name: frames, batch_size: 4, count: 150, inputs: "
        "{input: {data_type: TYPE_FP32, dims: [3, 224, 224], random_data: true}}}]\n"
    )
    modelgen.write_model(tmp_path, "classifier", modelgen.classifier(), slow)
    srv = run_appliance(tmp_path, load_model=["simple"])
    client = httpclient.InferenceServerClient(srv.url)
    errors: list[BaseException] = []

    def load() -> None:
        try:
            httpclient.InferenceServerClient(srv.url, network_timeout=120).load_model("classifier")
        except BaseException as exc:
            errors.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    _until(lambda: _rows(client, "classifier") == [("1", "LOADING")])
    assert not client.is_model_ready("classifier")
    frame = httpclient.InferInput("input", [1, 3, 224, 224], "FP32")
    frame.set_data_from_numpy(np.zeros((1, 3, 224, 224), np.float32))
    with pytest.raises(InferenceServerException, match=r"not ready \(LOADING") as info:
        client.infer("classifier", [frame])
    assert info.value.status() == "503"
    with pytest.raises(InferenceServerException, match="is loading right now") as info:
        client.unload_model("classifier")
    assert info.value.status() == "400"
    assert _serves(client) == "1"  # the other model is not affected
    loader.join(120)
    assert errors == []
    assert _rows(client, "classifier") == [("1", "READY")]
    assert client.infer("classifier", [frame]).as_numpy("output").shape == (1, 1000)


def test_a_failing_warm_up_keeps_the_old_copy_serving(run_appliance, tmp_path: Path) -> None:
    folder = modelgen.write_model(tmp_path, "mm", _matmul_4(), "max_batch_size: 8\n")
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url)

    def infer() -> np.ndarray:
        x = httpclient.InferInput("x", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), np.float32))
        out: np.ndarray = client.infer("mm", [x]).as_numpy("y")
        return out

    np.testing.assert_array_equal(infer(), np.full((1, 4), 4.0))
    # the engine accepts the declared shape but cannot run it: the warm-up finds out
    (folder / "config.yaml").write_text(
        "max_batch_size: 8\nmodel_warmup: [{name: wrong_width, batch_size: 1, inputs: "
        "{x: {data_type: TYPE_FP32, dims: [3], zero_data: true}}}]\n"
    )
    with pytest.raises(InferenceServerException, match="warm-up sample 'wrong_width' failed"):
        client.load_model("mm")
    np.testing.assert_array_equal(infer(), np.full((1, 4), 4.0))

    # a warm-up file of the wrong size is a config error naming the field
    (folder / "warmup").mkdir()
    (folder / "warmup" / "x.bin").write_bytes(b"\0" * 12)
    (folder / "config.yaml").write_text(
        "max_batch_size: 8\nmodel_warmup: [{name: from_file, inputs: "
        "{x: {data_type: TYPE_FP32, dims: [4], input_data_file: x.bin}}}]\n"
    )
    with pytest.raises(InferenceServerException) as info:
        client.load_model("mm")
    assert "model_warmup[0].inputs.x: input_data_file 'x.bin' has 12 bytes" in str(info.value)
    (folder / "warmup" / "x.bin").write_bytes(np.ones(4, np.float32).tobytes())
    client.load_model("mm")  # now right: it loads, and serves
    np.testing.assert_array_equal(infer(), np.full((1, 4), 4.0))


def test_a_failed_in_place_swap_restores_the_old_copy(run_appliance, tmp_path: Path) -> None:
    modelgen.write_model(tmp_path, "mm", _matmul_4(), "max_batch_size: 8\n")
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url)
    broken = {
        "max_batch_size": 8,
        "model_warmup": [
            {
                "name": "wrong_width",
                "batch_size": 1,
                "inputs": {"x": {"data_type": "TYPE_FP32", "dims": [3], "zero_data": True}},
            }
        ],
    }
    status, body = post_json(
        f"http://{srv.url}/v2/repository/models/mm/load",
        {"parameters": {"in_place": True, "config": json.dumps(broken)}},
    )
    assert status == 400 and "warm-up sample 'wrong_width' failed" in body
    assert _rows(client, "mm") == [("1", "READY")]
    assert client.get_model_config("mm").get("model_warmup") is None  # the old config


# ---- versions and bad input ---------------------------------------------------------------


def test_requests_without_a_version_go_to_the_newest_ready_one(
    run_appliance, tmp_path: Path
) -> None:
    folder = modelgen.write_model(
        tmp_path, "simple", modelgen.simple_add_sub(), "version_policy: {all: {}}\n"
    )
    (folder / "2").mkdir()
    (folder / "2" / "model.onnx").write_bytes(b"not an onnx model")
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url)
    assert _rows(client, "simple") == [("1", "READY"), ("2", "UNAVAILABLE")]
    assert _serves(client) == "1"
    with pytest.raises(InferenceServerException, match="version 2 is not ready") as info:
        client.infer("simple", _simple_inputs(), model_version="2")
    assert info.value.status() == "503"


def test_bad_input_is_a_clear_client_error_and_disturbs_nothing(
    run_appliance, tmp_path: Path
) -> None:
    folder = modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url)
    url = f"http://{srv.url}/v2/repository/models"

    (folder / "v2").mkdir()
    status, body = post_json(f"{url}/simple/load", {})
    assert status == 400 and "version folder 'v2' is not a version number" in body
    (folder / "v2").rmdir()

    (folder / "2").mkdir()  # a version folder without its model file
    (folder / "config.yaml").write_text("backend: onnxruntime\n")
    status, body = post_json(f"{url}/simple/load", {})
    assert status == 400 and "model file" in body and "does not exist" in body
    shutil.rmtree(folder / "2")

    (folder / "config.yaml").write_text(
        "max_batch_size: 4\ndynamic_batching: {preferred_batch_size: [8]}\n"
    )
    status, body = post_json(f"{url}/simple/load", {})
    assert status == 400 and "preferred_batch_size: [8] exceed max_batch_size 4" in body

    for name, call, expected in [
        ("nope", "load", (404, "failed to load 'nope', failed to poll from model repository")),
        ("nope", "unload", (404, "is not loaded")),
        ("simple", "load", (400, "unsupported load parameter(s) ['colour']")),
        ("simple", "load", (400, "'in_place' must be true or false")),
    ]:
        params = {"colour": "red"} if "colour" in expected[1] else {}
        if "in_place" in expected[1]:
            params = {"in_place": "maybe"}
        status, body = post_json(f"{url}/{name}/{call}", {"parameters": params})
        assert (status, expected[1] in body) == (expected[0], True), body
    assert _serves(client) == "1"  # through all of it


# ---- the settings, checked at the edge ------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"model_control_mode": "auto"}, "model_control_mode: expected one of none, explicit"),
        ({"load_model": "m", "model_control_mode": "poll"}, "load_model: only applies to"),
        ({"load_model": [""]}, "load_model: expected a list of model names"),
        ({"repository_poll_secs": 0}, "repository_poll_secs: expected a number of seconds > 0"),
        ({"memory_limit": "a lot"}, "memory_limit: expected a size such as 64MiB"),
        ({"require_admin_token": "yes"}, "require_admin_token: expected true or false"),
    ],
)
def test_control_settings_name_the_field(options: dict[str, Any], expected: str) -> None:
    from appliance.config.server_config import load_server_config

    with pytest.raises(ConfigError, match=f"^<command line>: {expected}"):
        load_server_config(None, options)


def test_control_flags_reach_the_config() -> None:
    from appliance.cli import build_parser
    from appliance.config.server_config import load_server_config

    flags = ["--load-model", "a", "--load-model", "b", "--memory-limit", "1.5GiB"]
    flags += ["--model-control-mode", "explicit", "--repository-poll-secs", "2"]
    args = build_parser().parse_args(["serve", *flags])
    config = load_server_config(
        None,
        {
            "model_control_mode": args.model_control_mode,
            "load_model": args.load_model,
            "repository_poll_secs": args.repository_poll_secs,
            "memory_limit": args.memory_limit,
        },
    )
    assert config.load_model == ("a", "b") and config.memory_limit == int(1.5 * 2**30)
    assert config.model_control_mode == "explicit" and config.repository_poll_secs == 2.0
