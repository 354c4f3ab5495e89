"""Prometheus metrics with Triton's names and labels."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from appliance.adapters.metrics import MetricsExporter, Sources
from appliance.core.stats import ModelStats, MqttStats


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def test_metrics_follow_triton_names(run_appliance) -> None:
    srv = run_appliance()
    client = httpclient.InferenceServerClient(srv.url)
    inputs = [httpclient.InferInput(n, [3, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(np.zeros((3, 16), np.int32))
    client.infer("simple", inputs)
    client.infer("simple", inputs)
    bad = httpclient.InferInput("INPUT0", [3, 16], "FP32")
    bad.set_data_from_numpy(np.zeros((3, 16), np.float32))
    with pytest.raises(InferenceServerException):
        client.infer("simple", [bad, inputs[1]])

    m = _scrape(srv.metrics_url)
    label = '{model="simple",version="1"}'
    assert m["nv_inference_request_success" + label] == 2
    assert m['nv_inference_request_failure{model="simple",reason="OTHER",version="1"}'] == 1
    assert m['nv_inference_request_failure{model="simple",reason="REJECTED",version="1"}'] == 0
    assert m["nv_inference_count" + label] == 6
    assert m["nv_inference_exec_count" + label] == 2
    assert m["nv_inference_pending_request_count" + label] == 0
    for name in ("request", "queue", "compute_input", "compute_infer", "compute_output"):
        assert f"nv_inference_{name}_duration_us" + label in m
    assert m["nv_inference_compute_infer_duration_us" + label] > 0
    assert m["process_resident_memory_bytes"] > 10 * 2**20
    assert m["nv_cpu_memory_total_bytes"] >= m["nv_cpu_memory_used_bytes"] > 0
    assert m["nv_inference_count" + '{model="classifier",version="1"}'] == 0
    # counters keep Triton's exact names (no _total suffix)
    assert not any(re.match(r"nv_\w+_total\{", k) for k in m)


def _names(text: str) -> set[str]:
    """The sample names of an exposition (labels and values dropped)."""
    return {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_latency_summaries_follow_triton_when_turned_on(run_appliance) -> None:
    srv = run_appliance(metrics_summary_latencies=True)
    client = httpclient.InferenceServerClient(srv.url)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(np.ones((1, 16), np.int32))
    for _ in range(4):
        client.infer("simple", inputs)
    m = _scrape(srv.metrics_url)
    for kind in ("request", "queue", "compute_input", "compute_infer", "compute_output"):
        name = f"nv_inference_{kind}_summary_us"
        assert m[name + '_count{model="simple",version="1"}'] == 4
        for q in ("0.5", "0.9", "0.95", "0.99"):
            assert m[f'{name}{{model="simple",quantile="{q}",version="1"}}'] >= 0
    # the sum is the cumulative counter's figure, rounded per request
    total = m['nv_inference_request_summary_us_sum{model="simple",version="1"}']
    assert 0 < total <= m['nv_inference_request_duration_us{model="simple",version="1"}']


def test_summaries_are_off_by_default(run_appliance) -> None:
    srv = run_appliance()
    text = urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode()
    assert "summary_us" not in text


def test_openmetrics_is_negotiated_with_triton_names_kept(run_appliance) -> None:
    srv = run_appliance()
    request = urllib.request.Request(
        srv.metrics_url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        text = response.read().decode()
    assert text.rstrip().endswith("# EOF")
    names = _names(text)
    assert "nv_inference_request_success" in names
    assert not any(n.startswith("nv_") and n.endswith("_total") for n in names)
    plain = urllib.request.urlopen(srv.metrics_url, timeout=10)
    assert plain.headers["Content-Type"].startswith("text/plain")


def test_label_values_are_escaped() -> None:
    stats = ModelStats('we"ird\\name\n', "1")
    body, _ = MetricsExporter(Sources(models=lambda: [stats])).render()
    assert b'model="we\\"ird\\\\name\\n"' in body


DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "appliance-dashboard.json"


def _dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return {n for e in exprs for n in re.findall(r"\b(?:nv|appliance|process)_\w+", e)}


def test_every_metric_the_dashboard_queries_is_exposed(run_appliance) -> None:
    wanted = _dashboard_metrics()
    assert {
        "nv_inference_count",
        "appliance_mqtt_connected",
        "appliance_model_memory_bytes",
    } <= wanted
    # a real server (summaries on, a memory budget) exposes all but the MQTT bridge's
    srv = run_appliance(metrics_summary_latencies=True, memory_limit="1GiB")
    exposed = _names(urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode())
    # the MQTT bridge's metrics appear once a bridge runs (tests/adapters/test_mqtt.py);
    # here the same collector is given a bridge's counters
    stats = ModelStats("m", "1")
    bridge = MqttStats()
    body, _ = MetricsExporter(Sources(models=lambda: [stats], mqtt=bridge.snapshot)).render()
    exposed |= _names(body.decode())
    missing = {n for n in wanted if n not in exposed and n + "_count" not in exposed}
    assert not missing, f"the dashboard queries metrics nobody exposes: {sorted(missing)}"
