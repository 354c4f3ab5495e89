"""``appliance tune`` on a small model and a small search space, against a live server.

Timing is never asserted: the winner must be the best of what was measured in the
same run (so at least as fast as the running config, which is measured too), every
measured config must fit the memory budget, the running config must be back at the
end, and the written file must load as the model's config.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml

from appliance.config.model_config import parse_model_config
from appliance.config.triton_config import pbtxt_to_dict
from appliance.core.instances import cpu_share
from appliance.errors import ApplianceError
from appliance.perf.command import new_loop
from appliance.perf.runner import Point
from appliance.perf.tune import Options, candidate, render, split_threads, tune
from devtools import modelgen


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    modelgen.write_model(repo, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
    return repo


def _config(url: str) -> dict:
    client = httpclient.InferenceServerClient(url)
    try:
        return client.get_model_config("simple")
    finally:
        client.close()


def test_tune_finds_the_best_measured_config_within_the_budget(run_appliance, repo, tmp_path):
    srv = run_appliance(repo, model_control_mode="explicit", load_model=["simple"])
    before = _config(srv.url)
    budget = 64 * 2**20
    opts = Options(
        "simple", srv.url, max_batch_sizes=(1, 4), queue_delays_us=(0,), max_instances=2,
        memory_budget=budget, concurrency=4, warmup_s=0.1, window_s=0.4, min_requests=5,
    )  # fmt: skip
    out = tmp_path / "tuned.yaml"
    loop = new_loop()
    try:
        tuner, winner = loop.run_until_complete(tune(opts, out, apply=False))
    finally:
        loop.close()
    # nothing is refused: the server has no budget, and every candidate is a valid config
    # (the "threads=1 each" ones too: their parameter in Triton's JSON form)
    assert all(t.status == "ok" for t in tuner.trials), [(t.label, t.reason) for t in tuner.trials]
    assert any("each" in t.label for t in tuner.trials)
    measured = [t for t in tuner.trials if t.point is not None]
    assert measured[0].label.startswith("running config")  # the default, same run
    assert len(measured) >= 3  # the default plus mbs 1 and 4 at one instance at least
    assert winner.feasible and winner.point is not None
    assert winner.throughput == max(t.throughput for t in measured if t.feasible)
    assert winner.throughput >= measured[0].throughput
    assert all(0 < t.memory_bytes <= budget for t in measured)
    assert all(t.point.requests > 0 and not t.point.errors for t in measured)
    assert _config(srv.url) == before  # without --apply the running config is restored

    # the written file is the winner's config and loads as the model's config.yaml
    written = yaml.safe_load(out.read_text())
    assert written == winner.config
    shutil.copy(out, repo / "simple" / "config.yaml")
    client = httpclient.InferenceServerClient(srv.url)
    try:
        client.load_model("simple")
        assert client.is_model_ready("simple")
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for i in inputs:
            i.set_data_from_numpy(a)
        result = client.infer("simple", inputs)
        assert (result.as_numpy("OUTPUT0") == 2 * a).all()
        loaded = client.get_model_config("simple")
    finally:
        client.close()
    assert loaded["max_batch_size"] == winner.config["max_batch_size"]
    assert loaded["instance_group"][0]["count"] == winner.config["instance_group"][0]["count"]


def test_budget_refusal_stops_growing_and_apply_loads_the_winner(run_appliance, repo, tmp_path):
    # a tiny --memory-budget: every candidate is over it, so only the default is measured
    srv = run_appliance(repo, model_control_mode="explicit", load_model=["simple"])
    opts = Options(
        "simple", srv.url, max_batch_sizes=(2, 8), queue_delays_us=(50,), max_instances=3,
        memory_budget=1, concurrency=2, warmup_s=0.1, window_s=0.3, min_requests=5,
    )  # fmt: skip
    loop = new_loop()
    try:
        tuner, winner = loop.run_until_complete(tune(opts, None, apply=True))
    finally:
        loop.close()
    assert [t.status for t in tuner.trials][1:] == ["over-budget", "over-budget"]
    assert all(t.label.split()[1] == "n=1" for t in tuner.trials[1:])  # never grew
    # the default is over the budget as well: nothing is feasible, the default is returned
    assert winner is tuner.trials[0] and not winner.feasible


def test_candidates_and_pbtxt_output() -> None:
    base = {
        "name": "m", "backend": "onnxruntime", "platform": "onnxruntime_onnx",
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
        "instance_group": [{"name": "m_0", "kind": "KIND_CPU", "count": 1}],
        "dynamic_batching": {"max_queue_delay_microseconds": 100},
    }  # fmt: skip
    label, cfg = candidate(base, "openvino", 16, "pow2", 500, 3)
    assert label == "openvino n=3 mbs=16 pref=pow2 delay=500us"
    assert "platform" not in cfg and cfg["backend"] == "openvino"
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [2, 4, 8, 16]
    assert cfg["instance_group"] == [{"kind": "KIND_CPU", "count": 3}]
    assert base["max_batch_size"] == 8  # the running config is not changed in place
    # several ONNX Runtime instances: the "fixed slice each" way to share the cores too
    assert split_threads("onnxruntime", 2, base) == cpu_share(2)
    assert split_threads("onnxruntime", 1, base) == 0  # one instance has all the cores
    assert split_threads("openvino", 2, base) == 0  # OpenVINO shares its streams itself
    pinned = {**base, "parameters": {"intra_op_thread_count": "3"}}
    assert split_threads("onnxruntime", 2, pinned) == 0  # the config decides
    label, sliced = candidate(base, "onnxruntime", 8, "max", 100, 2, split=1)
    assert label == "onnxruntime n=2 threads=1 each mbs=8 pref=max delay=100us"
    assert sliced["parameters"] == {"intra_op_thread_count": {"string_value": "1"}}
    text = render(cfg, "pbtxt", "tuned")
    back = pbtxt_to_dict(text, "tuned.pbtxt")
    parsed = parse_model_config(back, "m", "tuned.pbtxt")
    assert parsed.max_batch_size == 16 and parsed.instance_count == 3
    with pytest.raises(ApplianceError):
        parse_model_config(
            pbtxt_to_dict(render({**cfg, "max_batch_size": -3}, "pbtxt", "x"), "x"), "m", "x"
        )


def test_readme_commands(run_appliance, repo, tmp_path, monkeypatch) -> None:
    """The README paragraph's two commands, pointed at a test server, kept short."""
    from appliance import cli

    srv = run_appliance(repo, model_control_mode="explicit", load_model=["simple"])
    monkeypatch.chdir(tmp_path)
    # a short window that still waits for 5 requests: a loaded machine leaves none empty
    short = ["-u", srv.url, "--warmup", "0.1", "--duration", "0.3"]
    short += ["--measurement-request-count", "5"]
    perf = ["perf", "-m", "simple", "--concurrency", "1:8:2x", "--csv", "simple.csv"]
    assert cli.main([*perf, *short, "--quiet"]) == 0
    assert len((tmp_path / "simple.csv").read_text().splitlines()) == 1 + 4  # 1, 2, 4, 8
    tune_cmd = ["tune", "simple", "--max-batch-sizes", "1,8", "--max-instances", "2"]
    assert cli.main([*tune_cmd, "--output", "simple.yaml", *short]) == 0
    written = parse_model_config(
        yaml.safe_load((tmp_path / "simple.yaml").read_text()), "simple", "simple.yaml"
    )
    assert written.max_batch_size in (1, 8)


def test_a_trial_that_measured_no_request_is_not_ok(run_appliance, repo, monkeypatch) -> None:
    # the measurement itself stands in for a window in which nothing completed (on a
    # real server that depends on timing); the server, its load API and configs are real
    from appliance.perf import tune as tune_module

    async def nothing_completed(s: Any) -> list[Point]:
        return [Point(s.transport, s.model, s.batch_size, concurrency=1, window_s=s.window_s)]

    monkeypatch.setattr(tune_module, "run", nothing_completed)
    srv = run_appliance(repo, model_control_mode="explicit", load_model=["simple"])
    opts = Options("simple", srv.url, max_batch_sizes=(1, 4), max_instances=2, window_s=0.3)
    loop = new_loop()
    try:
        tuner, winner = loop.run_until_complete(tune(opts, None, apply=False))
    finally:
        loop.close()
    assert tuner.trials and all(t.status == "no requests" for t in tuner.trials)
    assert tuner.trials[0].reason == "no request completed in its 0.3 s window"
    assert not any(t.feasible for t in tuner.trials) and not winner.feasible
