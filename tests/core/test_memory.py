"""Memory-capped instance groups: measured costs, admission within the budget and the
model's own limit, refusals that disturb nothing, and the figures in stats and metrics."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from serve_process import start_serve
from tritonclient.utils import InferenceServerException

from appliance.config.fields import ConfigError, parse_limit, physical_memory
from appliance.core.memory import Admission, MemoryBudget, MiB, Usage
from devtools import modelgen

UNSHARED = "parameters: {share_session: 'false'}\n"


def _big(seed: int = 3) -> bytes:
    """An MLP of ~24 MiB of weights: its cost dwarfs allocator noise."""
    return modelgen.mlp(1024, 2048, 16, seed=seed)


def _memory(client: httpclient.InferenceServerClient, model: str) -> int:
    stats = client.get_inference_statistics(model)["model_stats"]
    return sum(m["byte_size"] for s in stats for m in s["memory_usage"])


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _infer_big(client: httpclient.InferenceServerClient, model: str) -> None:
    inp = httpclient.InferInput("input", [1, 1024], "FP32")
    inp.set_data_from_numpy(np.ones((1, 1024), np.float32))
    assert client.infer(model, [inp]).as_numpy("output").shape == (1, 16)


# ---- the budget's arithmetic -----------------------------------------------------------


def test_admission_charges_the_budget_and_names_every_figure_when_refusing() -> None:
    budget = MemoryBudget(100 * MiB)
    other = object()
    budget.charge(other, "other", Usage(cpu=30 * MiB))
    admission = Admission(budget, "m", cap=50 * MiB)
    assert admission.fits(50 * MiB) and not admission.fits(51 * MiB)  # the cap binds
    admission.add(Usage(cpu=40 * MiB, gpu=5 * MiB))
    assert budget.used == 75 * MiB and budget.model_usage("m") == 45 * MiB
    assert admission.room() == 5 * MiB
    message = admission.refusal("another instance", 20 * MiB)
    assert message == (
        "model 'm': another instance needs 20.0 MiB, but the memory budget is 100.0 MiB, "
        "75.0 MiB in use, 25.0 MiB free and the model's own limit "
        "(parameters.memory_limit) is 50.0 MiB, 45.0 MiB already admitted"
    )
    budget.release(admission.owner)
    assert budget.used == 30 * MiB and budget.free() == 70 * MiB


def test_an_unlimited_budget_admits_everything_and_remembers_costs() -> None:
    budget = MemoryBudget(None)
    admission = Admission(budget, "m", cap=None)
    assert admission.fits(10**15) and budget.free() is None
    budget.remember("m", 1, Usage(cpu=8), Usage(cpu=2), 3)
    assert budget.estimate("m", 1) == (Usage(cpu=8), Usage(cpu=2), 3)
    assert budget.estimate("m", 7) == (Usage(cpu=8), Usage(cpu=2), 3)  # the newest known
    assert budget.estimate("n", 1) is None
    assert Usage(1, 2).json() == [
        {"type": "CPU", "id": 0, "byte_size": 1},
        {"type": "GPU", "id": 0, "byte_size": 2},
    ]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1.5GiB", int(1.5 * 2**30)),
        ("512MiB", 512 * MiB),
        ("1048576B", MiB),
        ("1048576 bytes", MiB),
        ("50%", physical_memory() // 2),
        (None, None),
        ("none", None),
        (0, None),
    ],
)
def test_memory_limit_values(value: Any, expected: int | None) -> None:
    assert parse_limit(value, "appliance.yaml", "memory_limit") == expected


@pytest.mark.parametrize("value", ["lots", "150%", "0%", "-1GiB", "%", 60, "60"])
def test_bad_memory_limits_name_the_field(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^appliance.yaml: memory_limit: expected a"):
        parse_limit(value, "appliance.yaml", "memory_limit")


# ---- end to end: real models, real measurements ----------------------------------------


@pytest.fixture
def own_process() -> Iterator[Callable[..., tuple[str, str]]]:
    """``appliance serve`` of a repository in a process of its own, as on a device:
    (its HTTP address, its metrics URL). A measurement is the process's own growth,
    so inside the test process it would depend on what ran there before: ONNX
    Runtime's one-time memory goes to the first session a process creates, and the
    servers and garbage of earlier tests share the process."""
    started: list[subprocess.Popen[str]] = []

    def start(repository: Path, *options: str) -> tuple[str, str]:
        proc, port, lines = start_serve("--model-repository", str(repository), *options)
        started.append(proc)
        found = re.search(r"metrics (http://127\.0\.0\.1:\d+/metrics)", "".join(lines))
        assert found, "".join(lines)
        return f"127.0.0.1:{port}", found.group(1)

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=60)


def test_instances_are_admitted_while_they_fit_the_models_limit(
    own_process: Callable[..., tuple[str, str]], tmp_path: Path
) -> None:
    # a small model first: ONNX Runtime's one-time start-up memory is charged to it
    modelgen.write_model(tmp_path, "a_first", modelgen.simple_add_sub())
    url, metrics_url = own_process(tmp_path)
    client = httpclient.InferenceServerClient(url)
    # the big one loaded alone, once the server is up: nothing else that starts up
    # allocates or frees beside its measurement
    modelgen.write_model(tmp_path, "big", _big(), UNSHARED)
    client.load_model("big")
    one = _memory(client, "big")  # what one instance with its own session costs
    assert one > 20 * MiB  # its ~24 MiB of weights are in the figure

    # four asked for, room for about two and a half: fewer than four are admitted, the
    # copy stays within the limit, and config, statistics and metrics say the same.
    # (How many exactly depends on what each instance measures: not asserted.)
    limit = int(2.5 * one)
    config = {
        "instance_group": [{"count": 4, "kind": "KIND_CPU"}],
        "parameters": {
            "memory_limit": {"string_value": f"{limit}B"},
            "share_session": {"string_value": "false"},
        },
    }
    client.load_model("big", config=json.dumps(config))
    admitted = client.get_model_config("big")["instance_group"][0]["count"]
    assert 1 <= admitted < 4
    assert one <= _memory(client, "big") <= limit
    metrics = _scrape(metrics_url)
    assert metrics['appliance_model_instances{model="big",version="1"}'] == admitted
    assert metrics['appliance_model_instances_requested{model="big",version="1"}'] == 4
    _infer_big(client, "big")

    # with one shared session, further instances cost only their working memory: all
    # four fit where unshared ones did not
    config["parameters"]["share_session"] = {"string_value": "true"}
    client.load_model("big", config=json.dumps(config))
    assert client.get_model_config("big")["instance_group"][0]["count"] == 4
    assert _memory(client, "big") <= limit
    _infer_big(client, "big")


def test_a_model_that_cannot_fit_one_instance_is_refused_and_nothing_else_changes(
    own_process: Callable[..., tuple[str, str]], tmp_path: Path
) -> None:
    # what the small model costs a fresh server (ONNX Runtime's one-time start-up memory
    # is charged to the first session of a process: each server here is a new one)
    modelgen.write_model(tmp_path, "a_first", modelgen.simple_add_sub())
    small = _memory(httpclient.InferenceServerClient(own_process(tmp_path)[0]), "a_first")
    modelgen.write_model(tmp_path, "big", _big())
    limit = small + 8 * MiB  # the big model needs ~24 MiB
    url, metrics_url = own_process(tmp_path, "--memory-limit", f"{limit}B")
    client = httpclient.InferenceServerClient(url)
    rows = {r["name"]: r for r in client.get_model_repository_index()}
    assert rows["a_first"]["state"] == "READY"
    reason = rows["big"]["reason"]
    assert rows["big"]["state"] == "UNAVAILABLE"
    assert reason.startswith("model 'big': one instance "), reason
    assert " needs " in reason
    assert f"the memory budget is {limit / MiB:.1f} MiB" in reason and "in use" in reason
    with pytest.raises(InferenceServerException, match=r"one instance .*needs") as info:
        client.load_model("big")
    assert info.value.status() == "400"
    # the model already serving was not disturbed, and the budget holds only it
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(np.ones((1, 16), np.int32))
    np.testing.assert_array_equal(client.infer("a_first", inputs).as_numpy("OUTPUT0"), 2)
    metrics = _scrape(metrics_url)
    assert metrics["appliance_memory_budget_bytes"] == limit
    assert metrics["appliance_memory_budget_used_bytes"] == _memory(client, "a_first")


def test_statistics_and_metrics_report_each_versions_memory(run_appliance) -> None:
    srv = run_appliance()  # the demo models, unlimited budget
    client = httpclient.InferenceServerClient(srv.url)
    stats = client.get_inference_statistics("classifier")["model_stats"][0]
    [usage] = stats["memory_usage"]
    assert usage["type"] == "CPU" and usage["id"] == 0 and usage["byte_size"] > 0
    metrics = _scrape(srv.metrics_url)
    label = '{model="classifier",type="CPU",version="1"}'
    assert metrics["appliance_model_memory_bytes" + label] == usage["byte_size"]
    assert metrics["appliance_memory_budget_bytes"] == -1  # unlimited
    total = _memory(client, "")  # every model of the demo repository
    assert metrics["appliance_memory_budget_used_bytes"] == total


NEEDS_WIDE_PY = """
import numpy as np
from appliance import python_model as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "x").as_numpy()
        if x.shape[-1] < 8:  # as a detector that refuses an input smaller than its stride
            raise ValueError(f"width {x.shape[-1]} is below 8")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", x.sum(axis=-1, keepdims=True))])]
"""

NEEDS_WIDE_CONFIG = """
backend: python
max_batch_size: 0
input: [{name: x, data_type: TYPE_FP32, dims: [-1]}]
output: [{name: y, data_type: TYPE_FP32, dims: [1]}]
"""


def test_a_dynamic_shape_or_a_failed_probe_is_named_a_lower_bound(
    run_appliance, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    frame = modelgen.frame_mean()  # dims [-1, -1, 3]: its probe is a 1x1 frame
    modelgen.write_model(tmp_path, "dynamic", frame)
    warmed = modelgen.write_model(tmp_path, "warmed", frame)
    (warmed / "config.yaml").write_text(
        "model_warmup:\n"
        "  - name: full_hd\n"
        "    batch_size: 1\n"
        "    inputs: {frame: {data_type: TYPE_UINT8, dims: [1080, 1920, 3], zero_data: true}}\n"
    )
    fixed = modelgen.write_model(tmp_path, "fixed", frame)  # the config states the frame
    (fixed / "config.yaml").write_text(
        "input: [{name: frame, data_type: TYPE_UINT8, dims: [480, 640, 3]}]\n"
    )
    modelgen.write_model(tmp_path, "static", modelgen.simple_add_sub())
    folder = tmp_path / "needs_wide"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(NEEDS_WIDE_PY)
    (folder / "config.yaml").write_text(NEEDS_WIDE_CONFIG)
    with caplog.at_level("WARNING", logger="appliance.core.loader"):
        srv = run_appliance(tmp_path)
    warnings = {
        name: [r.getMessage() for r in caplog.records if f"model '{name}'" in r.getMessage()]
        for name in ("dynamic", "warmed", "fixed", "static", "needs_wide")
    }
    (dynamic,) = warnings["dynamic"]
    assert "memory is a lower bound: declare a model_warmup at your largest input" in dynamic
    assert "input 'frame' [-1, -1, 3] is measured with each dynamic dim at 1" in dynamic
    (failed,) = warnings["needs_wide"]
    assert "memory is a lower bound" in failed
    assert "the implicit warm-up run failed (memory probe: " in failed and "below 8" in failed
    assert warnings["warmed"] == warnings["fixed"] == warnings["static"] == []
    metrics = _scrape(srv.metrics_url)
    for name, expected in (("dynamic", 1), ("needs_wide", 1), ("warmed", 0), ("fixed", 0)):
        key = f'appliance_model_memory_lower_bound{{model="{name}",version="1"}}'
        assert metrics[key] == expected, name
    # the model whose probe failed still serves
    client = httpclient.InferenceServerClient(srv.url)
    x = httpclient.InferInput("x", [8], "FP32")
    x.set_data_from_numpy(np.ones(8, np.float32))
    assert client.infer("needs_wide", [x]).as_numpy("y").tolist() == [8.0]
