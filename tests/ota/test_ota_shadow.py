"""Shadow probation's policy and verdicts (pure), and one run against a real server:
the candidate's mirrored outputs judged by a bundle's thresholds."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import urllib3

from appliance.ota import OtaError, report, shadow, watch
from appliance.ota.server_api import ServerApi
from appliance.ota.state import AgentState, Job
from devtools import modelgen
from tests.ota_helpers import Fleet, LocalDevice
from tests.ota_models import Traffic, release, served, weights

POLICY = {"requests": 10, "sample_rate": 1.0, "outputs": {"output": {"min_top1_agreement": 0.9}}}


def _report(
    rows: int, agree: int, diff: Any = 0.0, compared: int = 10, **kw: Any
) -> dict[str, Any]:
    out = {
        "rows": rows,
        "top1_agree": agree,
        "max_abs_diff": diff,
        "mismatched": kw.pop("mismatched", 0),
    }
    return {"compared": compared, "failed": kw.pop("failed", 0), "outputs": {"output": out}}


def test_verdicts() -> None:
    policy = shadow.parse(POLICY)
    assert policy is not None and policy.outputs["output"].min_top1_agreement == 0.9
    assert shadow.judge(_report(10, 10), policy, final=True) == ""
    assert "top-1 agreement 0.800 over 10 row(s) is below 0.9" in shadow.judge(
        _report(10, 8), policy, True
    )
    assert shadow.judge(_report(3, 2, compared=3), policy, final=False) == ""  # may still rise
    strict = shadow.parse({**POLICY, "outputs": {"output": {"max_abs_diff": 0.01}}})
    assert strict is not None
    assert "max abs diff 0.5 is above 0.01" in shadow.judge(_report(3, 3, 0.5, 3), strict, False)
    assert "max abs diff inf" in shadow.judge(_report(3, 3, "inf", 3), strict, False)
    assert "failed 1 mirrored" in shadow.judge(_report(3, 3, failed=1), policy, False)
    assert "differed in shape or datatype 2" in shadow.judge(
        _report(3, 3, mismatched=2), policy, False
    )
    required = shadow.parse({**POLICY, "required": True})
    assert required is not None
    assert "only 4 of 10 required" in shadow.judge(_report(4, 4, compared=4), required, True)
    assert shadow.judge(_report(4, 4, compared=4), policy, True) == ""
    summary = shadow.summary(_report(10, 9), "")
    assert summary["outputs"]["output"]["top1_agreement"] == 0.9 and summary["verdict"] == "passed"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ([], "expected an object"),
        ({"colour": 1}, "unknown field(s) ['colour']"),
        ({"requests": 0}, "'requests' must be a number in [1, 100000]"),
        ({"sample_rate": 2}, "'sample_rate' must be a number in [1e-06, 1]"),
        ({"required": "yes"}, "'required' must be true or false"),
        ({"outputs": {"o": {}}}, "outputs.o must set min_top1_agreement and/or max_abs_diff"),
        (
            {"outputs": {"o": {"min_top1_agreement": 1.5}}},
            "'min_top1_agreement' must be a number in [0, 1]",
        ),
        ({"outputs": {"../x": {"max_abs_diff": 1}}}, "shadow policy output name"),
    ],
)
def test_a_bad_policy_is_named(raw: Any, expected: str) -> None:
    with pytest.raises(
        OtaError,
        match=expected.replace("[", r"\[")
        .replace("]", r"\]")
        .replace("(", r"\(")
        .replace(")", r"\)"),
    ):
        shadow.parse(raw)
    assert shadow.parse(None) is None


def test_a_shadow_run_against_a_real_server(tmp_path: Path, run_appliance: Any) -> None:
    folder = modelgen.write_model(tmp_path, "m", modelgen.mlp(seed=1), "max_batch_size: 8\n", 1)
    shutil.copytree(folder / "1", folder / "2")  # the candidate agrees exactly
    (folder / "3").mkdir()
    (folder / "3" / "model.onnx").write_bytes(modelgen.mlp(seed=1, retrained=(2, 5)))
    url = f"http://{run_appliance(tmp_path, model_control_mode='explicit', load_model=['m']).url}"
    api = ServerApi(url)
    body = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 256], "data": [0.5] * 256}]
    }

    def traffic() -> None:  # the device's live requests while the agent waits
        assert urllib3.request("POST", f"{url}/v2/models/m/infer", json=body).status == 200

    for candidate, rule, refused in (
        (2, {"max_abs_diff": 0.0}, ""),
        (3, {"max_abs_diff": 1e-9}, "max abs diff"),
    ):
        api.load(
            "m",
            {"max_batch_size": 8, "version_policy": {"specific": {"versions": [1, candidate]}}},
            1,
        )
        policy = shadow.parse(
            {"requests": 5, "sample_rate": 1.0, "timeout_s": 60, "outputs": {"output": rule}}
        )
        assert policy is not None
        verdict, summary = shadow.run(
            api, "m", candidate, policy, 0.01, traffic, sleep=lambda _: traffic()
        )
        assert (verdict == "") == (refused == "") and refused in verdict, verdict
        assert summary["compared"] >= (5 if not refused else 1)


SHADOW = {"requests": 5, "sample_rate": 1.0, "timeout_s": 120,
          "outputs": {"output": {"max_abs_diff": 1e-4}}}  # fmt: skip


def test_the_agent_shadow_tests_a_candidate_before_the_switch(
    fleet: Fleet, device: LocalDevice
) -> None:
    """Live traffic mirrored to each candidate: one with the serving weights agrees and
    is switched to, with its agreement in the history; one with a retrained layer
    differs beyond the bundle's threshold and is refused before it ever serves."""
    release(fleet, 1, weights(1))
    assert device().run_once()
    release(fleet, 2, weights(1), shadow=SHADOW)
    with Traffic(device.url) as traffic:
        agent = device()
        assert agent.run_once(), agent.state.last_error
    last = agent.state.history[-1]
    assert last["result"] == "updated" and traffic.failed == 0
    assert last["shadow"]["verdict"] == "passed" and last["shadow"]["compared"] >= 5
    assert last["shadow"]["outputs"]["output"]["max_abs_diff"] == 0.0
    assert served(device.url)[0] == "2"
    release(fleet, 3, weights(1, retrained=(2, 9)), shadow=SHADOW)
    with Traffic(device.url) as traffic:
        agent = device()
        assert not agent.run_once()
    last = agent.state.history[-1]
    assert last["result"] == "rolled_back" and traffic.failed == 0
    assert "shadow probation: output 'output': max abs diff" in last["error"], last["error"]
    assert last["shadow"]["verdict"].startswith("output 'output'")
    assert served(device.url)[0] == "2" and 3 in agent.state.models["m"].bad


def test_a_shadow_without_traffic_goes_on_unless_required(
    fleet: Fleet, device: LocalDevice
) -> None:
    release(fleet, 1, weights(1))
    assert device().run_once()
    quiet = {**SHADOW, "timeout_s": 1}
    release(fleet, 2, weights(1), shadow=quiet)
    agent = device()
    assert agent.run_once(), agent.state.last_error
    assert "too little traffic" in agent.state.history[-1]["shadow"]["verdict"]
    release(fleet, 3, weights(1), shadow={**quiet, "required": True})
    agent = device()
    assert not agent.run_once()
    assert "only 0 of 5 required request(s) were compared" in agent.state.history[-1]["error"]
    assert served(device.url)[0] == "2"


def test_the_report_carries_the_shadow_summary_and_how_the_bundle_came() -> None:
    """What the fleet sees: the job's shadow summary and download while it runs, the
    last job's once it ended, and when a waiting job's window opens."""
    agreement = {"rows": 50, "top1_agreement": 0.98, "max_abs_diff": 0.1}
    summary = {"compared": 50, "failed": 0, "verdict": "passed", "outputs": {"output": agreement}}
    job = Job("m", 3, "m/m-3.bundle", 10, "0" * 64, shadow=summary, window_opens=1e9,
              download={"how": "delta", "bytes": 4, "saved": 6})  # fmt: skip
    state = AgentState(phase="switch", job=job)
    doc = report.payload("cam-1", state)
    assert doc["shadow"] == summary and doc["download"]["saved"] == 6
    assert doc["window_opens"] == 1e9
    refused = {**summary, "verdict": "output 'output': ..."}
    state = AgentState(history=[{"model": "m", "version": 3, "result": "rolled_back",
                                 "shadow": refused}])  # fmt: skip
    doc = report.payload("cam-1", state)
    assert doc["shadow"]["verdict"].startswith("output") and "download" not in doc
    assert "window_opens" not in doc


def test_fleet_watch_shows_what_the_devices_shadow_probations_saw() -> None:
    tally = watch.Tally()
    for device, agreement, diff in (("a", 0.99, 0.02), ("b", 0.96, "inf"), ("c", None, 0.0)):
        outputs = {"output": {"rows": 10, "top1_agreement": agreement, "max_abs_diff": diff}}
        tally.add(device, {"model": "m", "version": 3, "shadow": {"outputs": outputs}}, 0.0)
    tally.add("d", {"model": "m", "version": 2, "shadow": {"outputs": {}}}, 0.0)
    tally.add("e", {"model": "m", "version": 3, "shadow": "nonsense"}, 0.0)  # skipped
    assert tally.shadow("m", 3) == (
        "; shadow on 3 device(s): output top-1 >= 0.960, output max diff inf"
    )
    assert tally.shadow("m", 2) == "; shadow on 1 device(s): nothing compared"
    assert tally.shadow("m", 1) == ""
