"""A simulated fleet: hundreds of device agents against one static server and mosquitto.

A benchmark, not a test. It builds a signed TUF repository, serves it with one
``http.server`` (threaded, one process), starts a real mosquitto, and runs N
lightweight devices in a few worker processes. Each device runs the agent's real
check (ngclient refresh from its own pinned root and metadata folder, rollout
membership), the real resumable download verified against the signed target, the
real bundle inspection, and reports over MQTT like the agent (retained
``fleet/<device>/ota``). What it leaves out is the local appliance: no model is
loaded, so the figures are the fleet side's, not a device's load time (see
``tests/ota/`` and docs/ota.md for that).

Phases, timed from the publish: v1 to 10 % (until 95 % of that cohort reported
"updated"), widened to 100 % (until 95 % of all devices), then a bad v2 (every
device that takes it reports "rolled_back") watched by ``appliance fleet watch
--exit-on-halt``: the time until it has halted the rollout, and how many devices
took v2 before and after the halt.

    python benchmarks/bench_fleet.py --devices 500 --workers 4 --interval 10
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import urllib3
from paho.mqtt.enums import CallbackAPIVersion

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing
sys.path.insert(0, str(REPO_ROOT / "tests"))  # the broker and static-server helpers

from machine import describe  # noqa: E402
from mosquitto import Broker, find_mosquitto  # noqa: E402
from ota_helpers import StaticServer, start_fleet  # noqa: E402

from appliance.ota import OtaError, bundle, check, controls, download, repo  # noqa: E402
from appliance.ota.config import OtaConfig  # noqa: E402
from appliance.ota.rollout import Rollout, bucket  # noqa: E402
from appliance.ota.state import AgentState  # noqa: E402

PREFIX = "fleet"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def worker(ids: list[str], a: dict[str, Any], stop: Any) -> None:
    """One process running ``ids``' devices on a small thread pool."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sim-{ids[0]}")
    client.connect("127.0.0.1", a["broker"])
    client.loop_start()
    http = urllib3.PoolManager(maxsize=16)
    base = Path(a["tmp"])
    devices = {}
    for d in ids:
        cfg = OtaConfig(
            source=a["source"], trusted_root=Path(a["root"]), state_dir=base / d,
            server="http://127.0.0.1:9", model_repository=base, device_id=d,
        )  # fmt: skip
        devices[d] = (cfg, AgentState())
    due = {d: time.monotonic() + random.uniform(0, a["interval"]) for d in ids}
    busy: set[str] = set()
    lock = threading.Lock()

    def cycle(d: str) -> None:
        cfg, state = devices[d]
        try:
            offer = check.newest_offer(cfg, state)
            if offer is not None:
                path = download.fetch(
                    http, f"{cfg.source}targets/{offer.model}/"
                    f"{offer.target.hashes['sha256']}.{offer.target.path.split('/')[-1]}",
                    offer.target, cfg.state_dir / "downloads",
                )  # fmt: skip
                bundle.inspect(path)
                path.unlink()
                failing = offer.version in a["bad_versions"]
                ms = state.model(offer.model)
                if failing:
                    ms.bad.append(offer.version)
                else:
                    ms.current = offer.version
                report = {
                    "model": offer.model, "version": offer.version, "state": "idle",
                    "result": "rolled_back" if failing else "updated", "time": time.time(),
                }  # fmt: skip
                client.publish(f"{PREFIX}/{d}/ota", json.dumps(report), qos=1, retain=True)
        except OtaError as exc:
            log(f"{d}: {exc}")
        finally:
            spread = a["interval"] * a["jitter"]
            with lock:
                due[d] = time.monotonic() + a["interval"] + random.uniform(-spread, spread)
                busy.discard(d)

    with ThreadPoolExecutor(a["threads"]) as pool:
        while not stop.is_set():
            now = time.monotonic()
            with lock:
                ready = [d for d, t in due.items() if t <= now and d not in busy]
                busy.update(ready)
            for d in ready:
                pool.submit(cycle, d)
            time.sleep(0.05)
    client.loop_stop()


class Reports:
    """Every device's latest report, from the broker."""

    def __init__(self, port: int) -> None:
        self.latest: dict[str, dict[str, Any]] = {}
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-fleet")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.subscribe(f"{PREFIX}/+/ota", qos=1)
        self.client.loop_start()

    def _on_message(self, c: Any, u: Any, msg: Any) -> None:
        self.latest[msg.topic.split("/")[1]] = json.loads(msg.payload)

    def count(self, version: int, result: str, among: set[str]) -> int:
        return sum(
            1
            for d, r in list(self.latest.items())
            if d in among and r.get("version") == version and r.get("result") == result
        )


def wait_for(what: str, predicate: Any, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.1)
    raise SystemExit(f"timed out after {timeout}s waiting for {what}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=500)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--threads", type=int, default=8, help="per worker process")
    p.add_argument("--interval", type=float, default=10.0, help="check interval, seconds")
    p.add_argument("--jitter", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()
    binary = find_mosquitto()
    if binary is None:
        raise SystemExit("mosquitto not found: apt-get install mosquitto")
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    (tmp / "mosquitto").mkdir()
    broker = Broker(binary, tmp / "mosquitto", extra=["max_queued_messages 100000"])
    broker.start()
    fleet = start_fleet(tmp / "fleet")
    server: StaticServer = fleet.server
    ids = [f"dev-{i:05d}" for i in range(args.devices)]
    cohort = {d for d in ids if bucket("simple", d) < 10}
    everyone = set(ids)
    settings = {
        "broker": broker.port, "source": server.url, "tmp": str(tmp / "devices"),
        "root": str(fleet.repo / "metadata" / "1.root.json"), "interval": args.interval,
        "jitter": args.jitter, "threads": args.threads, "bad_versions": [2],
    }  # fmt: skip
    stop = mp.Event()
    chunks = [ids[i :: args.workers] for i in range(args.workers)]
    procs = [mp.Process(target=worker, args=(c, settings, stop)) for c in chunks]
    reports = Reports(broker.port)
    results: dict[str, Any] = {"machine": describe("tuf", "paho-mqtt")}
    try:
        for proc in procs:
            proc.start()
        log(f"{args.devices} devices in {args.workers} processes; warming up one interval")
        time.sleep(args.interval)
        before = len(server.requests)
        t = time.monotonic()
        time.sleep(args.interval)
        idle_rate = (len(server.requests) - before) / (time.monotonic() - t)
        results["idle metadata requests/s"] = round(idle_rate, 1)

        b1 = fleet.bundle(1)
        repo.publish(fleet.repo, fleet.keys, b1, Rollout(percent=10))
        need = int(len(cohort) * 0.95 + 0.999)
        results["10% cohort size"] = len(cohort)
        results["publish -> 95% of 10% cohort updated (s)"] = round(
            wait_for("10 %", lambda: reports.count(1, "updated", cohort) >= need, args.timeout),
            1,
        )
        controls.set_rollout(fleet.repo, fleet.keys, "simple", percent=100)
        need = int(len(everyone) * 0.95 + 0.999)
        results["widen to 100% -> 95% of all updated (s)"] = round(
            wait_for("100 %", lambda: reports.count(1, "updated", everyone) >= need, args.timeout),
            1,
        )
        b2 = fleet.bundle(2)
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        # the watcher runs before the release, as it would in a fleet
        watch = subprocess.Popen(
            [sys.executable, "-m", "appliance", "fleet", "watch", "--mqtt",
             f"127.0.0.1:{broker.port}", "--prefix", PREFIX, "--halt-at-failure-rate", "0.2",
             "--min-reports", "20", "--model", "simple", "--repo", str(fleet.repo),
             "--keys", str(fleet.keys), "--exit-on-halt", "--duration-s", str(args.timeout)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        time.sleep(5)  # its start-up (imports, retained reports)
        repo.publish(fleet.repo, fleet.keys, b2, Rollout(percent=100))
        t2 = time.monotonic()
        watch.wait(args.timeout + 30)
        halted = time.monotonic() - t2
        at_halt = reports.count(2, "rolled_back", everyone)
        results["bad v2 publish -> halted by fleet watch (s)"] = round(halted, 1)
        results["devices that took v2 by the halt"] = at_halt
        time.sleep(args.interval * (1 + args.jitter) + 2)
        results["devices that took v2 in total"] = reports.count(2, "rolled_back", everyone)
        results["watch exit status"] = watch.returncode
        results["check interval / jitter"] = f"{args.interval}s / {args.jitter}"
    finally:
        stop.set()
        for proc in procs:
            proc.join(30)
        server.stop()
        broker.stop()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
