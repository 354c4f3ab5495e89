"""Prometheus metrics with Triton's names and labels."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from device_trees import JETSON, X86, recorded
from http_helpers import Responses
from tritonclient.utils import InferenceServerException

from appliance.adapters.metrics import MetricsExporter, Sources
from appliance.core.stats import ModelStats, MqttStats
from appliance.telemetry import families as f


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
    # that failure was the caller's (the wrong datatype), and is counted so apart
    assert m["appliance_inference_request_client_error" + label] == 1
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
    # the device panels: what a Jetson Orin and an x86 box expose (recorded trees), and
    # the families only NVML and jetson-stats give, through the same collector
    exposed |= _names(_telemetry_page(recorded(JETSON).read))
    exposed |= _names(_telemetry_page(recorded(X86).read))
    library_only = [
        f.Sample(f.GPU_THROTTLE, ("0", "hw_thermal"), 0.0),
        f.Sample(f.EMC_FREQUENCY, ("jtop",), 2133e6),
        f.Sample(f.EMC_UTILIZATION, ("jtop",), 0.12),
    ]
    exposed |= _names(_telemetry_page(lambda: library_only))
    exposed |= _names(_streams_page())
    missing = {n for n in wanted if n not in exposed and n + "_count" not in exposed}
    assert not missing, f"the dashboard queries metrics nobody exposes: {sorted(missing)}"


def _streams_page() -> str:
    """The camera streams' families (appliance/streams/metrics.py) for one stream."""
    from prometheus_client import CollectorRegistry, generate_latest

    from appliance.config.streams_config import StreamConfig
    from appliance.streams.metrics import StreamsCollector
    from appliance.streams.stream import Stream

    stream = Stream(StreamConfig(name="door", url="rtsp://h/s"), None, None)  # type: ignore[arg-type]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StreamsCollector(lambda: [stream]))
    return generate_latest(registry).decode()


def _telemetry_page(read, accept: str = "") -> str:
    body, _ = MetricsExporter(Sources(models=lambda: [], telemetry=read)).render(accept)
    return body.decode()


def test_device_telemetry_is_exposed_with_units_in_the_names() -> None:
    page = _telemetry_page(recorded(JETSON).read)
    samples = dict(
        line.rsplit(" ", 1) for line in page.splitlines() if line.startswith("appliance_")
    )
    assert float(samples['appliance_temperature_celsius{kind="cpu",sensor="cpu-thermal",'
                         'source="thermal_zone"}']) == pytest.approx(48.531)
    assert float(samples['appliance_power_watts{rail="VDD_IN",sensor="ina3221 1-0040"}']) > 6
    assert samples['appliance_throttle_events_total{source="oc3"}'] == "0.0"
    assert samples['appliance_power_mode_info{id="0",mode="15W"}'] == "1.0"
    assert "# TYPE appliance_throttle_events_total counter" in page
    names = _names(page) | _names(_telemetry_page(recorded(X86).read))
    assert "appliance_energy_joules_total" in names
    units = ("_celsius", "_hertz", "_watts", "_joules_total", "_ratio", "_info", "_events_total")
    assert all(n.endswith(units) for n in names if n.startswith("appliance_"))
    # OpenMetrics keeps the counters' _total samples
    om = _telemetry_page(recorded(X86).read, "application/openmetrics-text; version=1.0.0")
    assert 'appliance_energy_joules_total{domain="package-0",sensor="intel-rapl:0"}' in om


def test_a_live_server_exposes_its_device(run_appliance) -> None:
    srv = run_appliance()
    srv.server.telemetry.sources = recorded(X86).sources  # as on an x86 box
    m = _scrape(srv.metrics_url)
    assert m['appliance_throttle_events_total{source="cpu_package_thermal"}'] == 7
    assert m['appliance_cpu_frequency_max_hertz{cpus="3",policy="3"}'] == 4.2e9
    assert 'nv_inference_count{model="simple",version="1"}' in m


def test_the_metrics_endpoint_answers_its_one_route_and_refuses_the_rest(run_appliance) -> None:
    """The metrics port is the HTTP front with ``GET /metrics`` as its one route: a
    scrape twice on one keep-alive connection (Prometheus's text, then OpenMetrics when
    asked), anything else 404 and the connection closed (nothing behind it)."""
    srv = run_appliance()
    port = int(srv.metrics_url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        answers = Responses(sock)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
        status, headers, body = answers.read()
        assert status == 200 and headers["content-type"].startswith("text/plain")
        assert b"nv_inference_count" in body
        accept = b"Accept: application/openmetrics-text; version=1.0.0\r\n"
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: t\r\n" + accept + b"\r\n")
        status, headers, body = answers.read()
        assert status == 200 and headers["content-type"].startswith("application/openmetrics")
        assert body.endswith(b"# EOF\n")
    for request in (b"GET /v2/health/ready HTTP/1.1", b"POST /metrics HTTP/1.1", b"GET /x y z"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request + b"\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
            status, _, body = Responses(sock).read()
            assert status == 404 and b"GET /metrics" in body, request
            sock.settimeout(10)
            assert sock.recv(100) == b""  # closed after the answer
