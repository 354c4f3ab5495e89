"""One device's update: publish -> serving, and what the update costs while it runs.

A benchmark, not a test. Starts ``appliance serve`` (a real process, explicit model
control) with the ``classifier`` demo model installed by the agent as version 1,
then publishes version 2 and runs the agent's cycle while a client sends steady
unversioned requests. Reports the time from publish to the new version serving
(probation excluded and included), request latency before and during the update,
failed requests, and the server's peak RSS during the update against before.

Then what the sealed loads, deltas and shadow traffic cost and save (benchmarks/ota_costs.py):
loading a model sealed at rest against plain, the bytes a delta bundle saves for a
model with one layer retrained, and what shadow traffic costs the live requests.

    python benchmarks/bench_ota_update.py --probation 2
    python benchmarks/bench_ota_update.py --parts sealed,delta,shadow --out report.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import urllib3
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests"))

import ota_costs  # noqa: E402
from machine import describe  # noqa: E402
from mosquitto import free_port  # noqa: E402
from ota_helpers import start_fleet  # noqa: E402

from appliance.ota import bundle, repo  # noqa: E402
from appliance.ota import config as ota_config  # noqa: E402
from appliance.ota.agent import Agent  # noqa: E402
from appliance.ota.rollout import Rollout  # noqa: E402
from devtools import modelgen  # noqa: E402


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probation", type=float, default=2.0, help="probation of the update (s)")
    p.add_argument(
        "--parts", default="update,sealed,delta,shadow", help="what to measure, comma-separated"
    )
    p.add_argument("--loads", type=int, default=5, help="loads per model for 'sealed'")
    p.add_argument("--requests", type=int, default=1000, help="requests per case for 'shadow'")
    p.add_argument("--out", type=Path, help="also write the cost tables here (Markdown)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    if "update" in parts:
        update(args.probation)
    tables: list[str] = []
    if "sealed" in parts:
        tables += ["### Loading a sealed model", "", *ota_costs.sealed_load(
            ((1024, 1024), (2048, 4096)), args.loads), ""]  # fmt: skip
    if "delta" in parts:
        tables += ["### Delta bundles", "", *ota_costs.delta_savings(), ""]
    if "shadow" in parts:
        tables += ["### Shadow traffic", "", *ota_costs.shadow_cost(args.requests), ""]
    if tables:
        report = "\n".join([f"Machine: {json.dumps(describe('onnxruntime'))}", "", *tables])
        print(report)
        if args.out:
            args.out.write_text(report + "\n")


def update(probation: float) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-ota-"))
    fleet = start_fleet(tmp / "fleet")
    models = tmp / "models"
    models.mkdir()
    port = free_port()
    config = tmp / "appliance.yaml"
    config.write_text(yaml.safe_dump({
        "model_repository": str(models), "http_port": port, "grpc_port": -1,
        "metrics_port": -1, "model_control_mode": "explicit", "log_level": "warning",
        "ota": {"source": fleet.server.url, "trusted_root": str(fleet.repo / "metadata" /
                "1.root.json"), "state_dir": str(tmp / "state"), "probation_s": probation,
                "probation_poll_s": 0.2, "max_latency_ratio": 0,
                # the fresh install gets no traffic and the bundles carry no vectors
                "probation_min_requests": 0},
    }))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    server = subprocess.Popen(
        [sys.executable, "-m", "appliance", "serve", "--config", str(config)], env=env
    )
    url = f"http://127.0.0.1:{port}"
    http = urllib3.PoolManager()
    for _ in range(600):
        try:
            if http.request("GET", f"{url}/v2/health/ready").status == 200:
                break
        except urllib3.exceptions.HTTPError:
            pass
        time.sleep(0.1)
    src = tmp / "src"
    for v in (1, 2):
        folder = modelgen.write_model(
            src, "classifier", modelgen.classifier(seed=v), modelgen.CLASSIFIER_CONFIG, v
        )
        bundle.build(folder, v, tmp / f"c{v}.bundle")
    agent = Agent(ota_config.load(config))
    results: dict[str, Any] = {"machine": describe("onnxruntime", "tuf")}
    try:
        repo.publish(fleet.repo, fleet.keys, tmp / "c1.bundle", Rollout())
        t = time.monotonic()
        assert agent.run_once(), agent.state.last_error
        results["fresh install: publish -> committed (s)"] = round(time.monotonic() - t, 2)
        body = {"inputs": [{"name": "IMAGE", "datatype": "FP32", "shape": [1, 3, 64, 64],
                            "data": np.random.rand(3 * 64 * 64).round(3).tolist()}]}  # fmt: skip
        meta = json.loads(http.request("GET", f"{url}/v2/models/classifier").data)
        body["inputs"][0]["name"] = meta["inputs"][0]["name"]
        body["inputs"][0]["shape"] = [1, *meta["inputs"][0]["shape"][1:]]
        n = int(np.prod(body["inputs"][0]["shape"]))
        body["inputs"][0]["data"] = np.random.rand(n).round(3).tolist()
        payload = json.dumps(body).encode()
        lat: dict[str, list[float]] = {"before": [], "during": []}
        phase, failures, served_v2 = ["before"], [0], [0.0]
        stop = threading.Event()
        peak, base = [0], rss(server.pid)

        def load() -> None:
            c = urllib3.PoolManager()
            while not stop.is_set():
                s = time.perf_counter()
                r = c.request("POST", f"{url}/v2/models/classifier/infer", body=payload)
                lat[phase[0]].append(time.perf_counter() - s)
                if r.status != 200:
                    failures[0] += 1
                elif not served_v2[0] and json.loads(r.data)["model_version"] == "2":
                    served_v2[0] = time.monotonic()
                peak[0] = max(peak[0], rss(server.pid))
                time.sleep(0.01)

        thread = threading.Thread(target=load)
        thread.start()
        time.sleep(3)
        base = rss(server.pid)
        phase[0] = "during"
        repo.publish(fleet.repo, fleet.keys, tmp / "c2.bundle", Rollout())
        t = time.monotonic()
        ok = agent.run_once()
        done = time.monotonic()
        stop.set()
        thread.join()
        results["update ok"] = ok
        results["publish -> v2 takes default traffic (s)"] = round(served_v2[0] - t, 2)
        results["publish -> committed, incl. probation (s)"] = round(done - t, 2)
        results["probation_s"] = probation
        for k, v in lat.items():
            a = np.array(v) * 1000
            results[f"latency {k} p50/p99 (ms)"] = f"{np.percentile(a, 50):.1f} / " \
                f"{np.percentile(a, 99):.1f} ({len(a)} requests)"  # fmt: skip
        results["failed requests during update"] = failures[0]
        results["server RSS before / peak during (MiB)"] = (
            f"{base / 2**20:.0f} / {peak[0] / 2**20:.0f}"
        )
    finally:
        agent.close()
        server.terminate()
        server.wait(30)
        fleet.server.stop()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
