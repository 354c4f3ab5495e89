"""What section 6 of the OTA work costs and saves, measured for bench_ota_update.py.

- ``sealed_load``: loading a model sealed at rest against the same model plain, in a
  real ``appliance serve`` (time from the repository load request to its answer,
  each load a new copy), and decrypting alone (MB/s).
- ``delta_savings``: the bytes a delta bundle saves over the full bundle for an MLP
  with one layer retrained (devtools/modelgen), and what building and applying cost.
- ``shadow_cost``: live request latency and server CPU per request with the
  candidate shadowing none, 10 % and 100 % of the traffic.

Next to the scripts, like ``probes.py``; each function returns rows for the report.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import urllib3
import yaml
from probes import cpu_seconds, free_port

from appliance.backends import sealed_crypto
from appliance.ota import bundle, delta
from devtools import modelgen

REPO_ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def _serve(config: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "appliance", "serve", "--config", str(config)], env=env
    )
    url = f"http://127.0.0.1:{yaml.safe_load(config.read_text())['http_port']}"
    http = urllib3.PoolManager()
    for _ in range(1200):  # bounded: 120 s
        try:
            if http.request("GET", f"{url}/v2/health/ready").status == 200:
                return proc, url
        except urllib3.exceptions.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not become ready")


def _config(tmp: Path, repo: Path, **extra: Any) -> Path:
    config = tmp / "appliance.yaml"
    doc = {
        "model_repository": str(repo), "http_port": free_port(), "grpc_port": -1,
        "metrics_port": -1, "model_control_mode": "explicit", "log_level": "warning",
        **extra,
    }  # fmt: skip
    config.write_text(yaml.safe_dump(doc))
    return config


def sealed_load(sizes: tuple[tuple[int, int], ...], loads: int) -> list[str]:
    """(in_features, hidden) MLPs, plain and sealed, each loaded ``loads`` times."""
    rows = [
        "| model file | plain load, median | sealed load, median | cost | decrypt alone |",
        "|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory(prefix="bench-sealed-") as t:
        tmp = Path(t)
        key = tmp / "device.key"
        public = sealed_crypto.parse_public(sealed_crypto.generate_key(key))
        repo = tmp / "models"
        names = []
        for fin, hidden in sizes:
            model = modelgen.mlp(fin, hidden, 16, seed=1)
            plain = f"plain_{hidden}"
            modelgen.write_model(repo, plain, model, "max_batch_size: 8\n")
            src = tmp / "src" / str(hidden)
            src.mkdir(parents=True)
            (src / "model.onnx").write_bytes(model)
            sealed_crypto.seal_folder(src, repo / f"sealed_{hidden}" / "1", [public])
            (repo / f"sealed_{hidden}" / "config.yaml").write_text("max_batch_size: 8\n")
            names.append((hidden, len(model)))
        proc, url = _serve(_config(tmp, repo, model_key_file=str(key)))
        http = urllib3.PoolManager()
        try:
            for hidden, size in names:
                times: dict[str, list[float]] = {"plain": [], "sealed": []}
                for i in range(loads):
                    for kind in ("plain", "sealed"):  # alternated: the same machine state
                        model_file = repo / f"{kind}_{hidden}" / "1" / "model.onnx"
                        os.utime(model_file, ns=(i + 1, i + 1))  # a new copy each load
                        start = time.perf_counter()
                        r = http.request("POST", f"{url}/v2/repository/models/{kind}_{hidden}/load")
                        times[kind].append(time.perf_counter() - start)
                        assert r.status == 200, r.data
                p, s = (statistics.median(times[k]) for k in ("plain", "sealed"))
                path = repo / f"sealed_{hidden}" / "1" / "model.onnx"
                opened = []
                for _ in range(5):
                    start = time.perf_counter()
                    sealed_crypto.open_sealed(path, sealed_crypto.load_private_key(key))
                    opened.append(time.perf_counter() - start)
                rate = size / statistics.median(opened) / MiB
                rows.append(
                    f"| {size / MiB:.1f} MiB | {p * 1000:.0f} ms | {s * 1000:.0f} ms | "
                    f"+{(s - p) * 1000:.0f} ms ({(s / p - 1) * 100:+.0f} %) | {rate:.0f} MiB/s |"
                )
        finally:
            proc.terminate()
            proc.wait(30)
    return rows


def delta_savings() -> list[str]:
    """Full bundle against delta, for the last layer and for a middle layer retrained."""
    rows = [
        "| pair (MLP 1024-1024-1024-16, 8.1 MiB of weights) | full bundle | delta | saved | "
        "build | apply |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as t:
        tmp = Path(t)
        base = modelgen.mlp(1024, 1024, 16, seed=1)
        for layer, what in ((2, "output layer retrained"), (1, "a hidden layer retrained")):
            src = tmp / f"src{layer}"
            modelgen.write_model(src, "m", base, "max_batch_size: 8\n", 1)
            retrained = modelgen.mlp(1024, 1024, 16, seed=1, retrained=(layer, 7))
            modelgen.write_model(src, "m", retrained, "max_batch_size: 8\n", 2)
            b1, b2, d = tmp / f"a{layer}.bundle", tmp / f"b{layer}.bundle", tmp / f"{layer}.delta"
            bundle.build(src / "m", 1, b1)
            bundle.build(src / "m", 2, b2)
            start = time.perf_counter()
            info = delta.build(b1, b2, d)
            built = time.perf_counter() - start
            installed = tmp / f"installed{layer}"
            bundle.extract(b1, installed, 1 << 30)
            start = time.perf_counter()
            delta.apply(
                d, installed, tmp / f"rebuilt{layer}.bundle", delta.content_hashes(b2), 1 << 30
            )
            applied = time.perf_counter() - start
            rows.append(
                f"| {what} | {info.target_bytes / MiB:.2f} MiB | "
                f"{info.delta_bytes / 1024:.0f} KiB | "
                f"{(1 - info.delta_bytes / info.target_bytes) * 100:.1f} % | {built:.1f} s | "
                f"{applied * 1000:.0f} ms |"
            )
    return rows


def _latencies(url: str, body: bytes, count: int) -> list[float]:
    http = urllib3.PoolManager()
    out = []
    for _ in range(count):  # one at a time: the device's steady traffic
        start = time.perf_counter()
        r = http.request("POST", f"{url}/v2/models/m/infer", body=body)
        out.append(time.perf_counter() - start)
        assert r.status == 200, r.data
    return out


def shadow_cost(count: int, rounds: int = 3) -> list[str]:
    """Live latency and server CPU per request, shadowing none, 10 % and all requests,
    the three cases alternated ``rounds`` times (``count`` requests per case in all)."""
    rates = (0.0, 0.1, 1.0)
    rows = [
        f"| shadowed ({count} sequential requests per case, MLP 1024, {rounds} rounds "
        "alternated) | p50 | p99 | server CPU / request | compared |",
        "|---|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory(prefix="bench-shadow-") as t:
        tmp = Path(t)
        repo = tmp / "models"
        base = modelgen.mlp(1024, 1024, 16, seed=1)
        modelgen.write_model(repo, "m", base, "max_batch_size: 8\n", 1)
        (repo / "m" / "2").mkdir()
        retrained = modelgen.mlp(1024, 1024, 16, seed=1, retrained=(2, 7))
        (repo / "m" / "2" / "model.onnx").write_bytes(retrained)
        proc, url = _serve(_config(tmp, repo))
        http = urllib3.PoolManager()
        config = {"max_batch_size": 8, "version_policy": {"specific": {"versions": [1, 2]}}}
        load = json.dumps({"parameters": {"config": json.dumps(config), "default_version": 1}})
        x = np.random.default_rng(1).standard_normal(1024).round(4).tolist()
        request = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1024], "data": x}]}
        body = json.dumps(request).encode()
        lat: dict[float, list[float]] = {r: [] for r in rates}
        cpu: dict[float, float] = dict.fromkeys(rates, 0.0)
        compared: dict[float, int] = dict.fromkeys(rates, 0)
        try:
            _latencies(url, body, 200)  # warm
            for _ in range(rounds):
                for rate in rates:
                    # a load that changes nothing keeps both copies and ends any shadow
                    r = http.request("POST", f"{url}/v2/repository/models/m/load", body=load)
                    assert r.status == 200, r.data
                    if rate:
                        start = {"parameters": {"version": 2, "sample_rate": rate,
                                                "max_requests": 10**6}}  # fmt: skip
                        r = http.request(
                            "POST", f"{url}/v2/repository/models/m/shadow", body=json.dumps(start)
                        )
                        assert r.status == 200, r.data
                    before = cpu_seconds(proc.pid)
                    lat[rate] += _latencies(url, body, count // rounds)
                    cpu[rate] += cpu_seconds(proc.pid) - before
                    if rate:
                        shadow = f"{url}/v2/repository/models/m/shadow"
                        compared[rate] += json.loads(http.request("GET", shadow).data)["compared"]
        finally:
            proc.terminate()
            proc.wait(30)
    for rate in rates:
        a = np.array(lat[rate]) * 1000
        per = cpu[rate] / len(a) * 1e6
        rows.append(
            f"| {rate:.0%} | {np.percentile(a, 50):.2f} ms | {np.percentile(a, 99):.2f} ms | "
            f"{per:.0f} µs | {compared[rate] if rate else '-'} |"
        )
    return rows
