"""Prometheus metrics with Triton's names and labels."""

from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


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
