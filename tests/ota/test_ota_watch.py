"""Device reports over a real mosquitto, and ``fleet watch`` halting a failing rollout."""

from __future__ import annotations

import contextlib
import io
import json
import queue
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from appliance.cli import build_parser, main
from appliance.config.mqtt_config import MqttConfig
from appliance.ota import devicekey, repo, report
from appliance.ota.agent import Agent
from appliance.ota.report import Reporter
from appliance.ota.state import AgentState
from appliance.ota.watch import Tally
from appliance.ota.watch import main as watch_main
from tests.mosquitto import Broker, Client, require_mosquitto
from tests.ota_helpers import Fleet, LocalDevice, retained_report
from tests.pace import scaled

ROOT = Path(__file__).resolve().parents[2]


def test_watch_halts_a_rollout_whose_devices_fail(
    fleet: Fleet, broker: Broker, tmp_path: Path, run_appliance: Any
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    running = run_appliance(models, model_control_mode="explicit")
    mqtt = MqttConfig(host="127.0.0.1", port=broker.port, topic_prefix="fleet")
    fleet.publish(1)
    cfg = fleet.device(tmp_path / "state", models, f"http://{running.url}", mqtt=mqtt)
    agent = Agent(cfg)
    try:
        assert agent.run_once()
        fleet.publish(2, delta=1)  # fails its self-test on every device
        assert not agent.run_once()
    finally:
        agent.close()
    doc = retained_report(broker.port, "cam-1")
    assert (doc["model"], doc["version"], doc["result"]) == ("simple", 2, "rolled_back")
    assert "self-test failed" in doc["error"]

    # four more devices report the same, one is still pending
    reporters = [Reporter(mqtt, f"cam-{i}") for i in range(2, 7)]
    for i, r in enumerate(reporters):
        result = "" if i == 0 else "rolled_back"
        r.publish({"model": "simple", "version": 2, "state": "idle", "result": result})
    for r in reporters:
        r.close()

    out = io.StringIO()
    args = [
        "fleet", "watch", "--mqtt", f"127.0.0.1:{broker.port}", "--prefix", "fleet",
        "--halt-at-failure-rate", "0.5", "--min-reports", "5",
        "--repo", str(fleet.repo), "--keys", str(fleet.keys),
        "--exit-on-halt", "--duration-s", str(scaled(120)),
    ]  # fmt: skip
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    assert "simple v2: rollout halted" in out.getvalue()
    (v2,) = [r for r in repo.listing(fleet.repo) if r["version"] == 2]
    assert v2["rollout"]["halted"] is True
    (v1,) = [r for r in repo.listing(fleet.repo) if r["version"] == 1]
    assert v1["rollout"]["halted"] is False


def watch(broker: Broker, *extra: str, reports: int | None = None, prefix: str = "fleet") -> str:
    """``appliance fleet watch`` in this process until it read and judged ``reports``
    reports (or halted, with --exit-on-halt); what it printed. Never a time: the bound
    only ends a watcher that would otherwise wait forever (a defect)."""
    out = io.StringIO()
    args = ["fleet", "watch", "--mqtt", f"127.0.0.1:{broker.port}", "--prefix", prefix,
            "--duration-s", str(scaled(120)), *extra]  # fmt: skip
    with contextlib.redirect_stdout(out):
        assert watch_main(build_parser().parse_args(args), stop_after=reports) == 0
    return out.getvalue()


def retain(client: Client, topic: str, payload: bytes) -> None:
    client.client.publish(topic, payload, qos=1, retain=True).wait_for_publish(5)


def as_devices(mqtt: MqttConfig, state: AgentState, devices: list[str]) -> None:
    """Retained reports of more devices in the very state of a real agent."""
    for d in devices:
        r = Reporter(mqtt, d)
        r.publish(report.payload(d, state))
        r.close()


def test_a_late_watcher_reads_retained_reports_as_state(
    fleet: Fleet, broker: Broker, device: LocalDevice
) -> None:
    """Devices that updated and then checked again (nothing new) show as updated, and
    devices that rolled back show as rolled back, to a watcher that starts only now."""
    mqtt = MqttConfig(host="127.0.0.1", port=broker.port, topic_prefix="fleet")
    agent = device(mqtt=mqtt)
    try:
        fleet.publish(1)
        assert agent.run_once()
        assert agent.run_once()  # a later check: nothing to do
        as_devices(mqtt, agent.state, [f"cam-{i}" for i in range(2, 6)])
        assert "simple v1: pending 0 updated 5 failed 0" in watch(broker, reports=5)
        listing = watch(broker, "--devices", reports=5)
        for d in range(2, 6):  # each device with the model version it serves
            assert f"device cam-{d}: software ? (SBOM none); models simple v1;" in listing

        fleet.publish(2, delta=1)  # fails its self-test
        assert not agent.run_once()
        assert agent.run_once()  # and the next check
        as_devices(mqtt, agent.state, [f"cam-{i}" for i in range(2, 6)])
    finally:
        agent.close()
    late = watch(broker, "--halt-at-failure-rate", "0.5", "--repo", str(fleet.repo),
                 "--keys", str(fleet.keys), "--exit-on-halt")  # fmt: skip
    assert "simple v2: pending 0 updated 0 failed 0 rolled back 5" in late
    assert "simple v2: rollout halted" in late


def test_malformed_reports_are_skipped_and_counted(broker: Broker) -> None:
    client = Client(broker.port)
    try:
        for i, payload in enumerate([
            b'{"model": "simple", "version": "3", "state": "idle", "result": "updated"}',
            b'{"model": "simple", "version": [1], "state": "idle", "result": "updated"}',
            b'{"model": "simple", "version": 1, "results": {"simple": {"version": "x"}}}',
            b"[1, 2]",
            b"not json",
        ]):  # fmt: skip
            retain(client, f"fleet/bad-{i}/ota", payload)
        good = {"model": "simple", "version": 1, "state": "idle", "result": "updated"}
        retain(client, "fleet/good/ota", json.dumps(good).encode())
    finally:
        client.close()
    out = watch(broker, reports=6)
    assert "skipped: 5 malformed report(s)" in out
    assert "simple v1: pending 0 updated 1" in out


def test_a_withdrawn_job_is_shown_and_never_counted_as_a_failure(broker: Broker) -> None:
    """A device's report goes from an update under way to withdrawn (the fleet halted
    the version): the watcher's line for that version says so, not "pending 1"."""
    mqtt = MqttConfig(host="127.0.0.1", port=broker.port, topic_prefix="fleet")
    r = Reporter(mqtt, "cam-1")
    r.publish({"model": "simple", "version": 2, "state": "download", "result": ""})
    r.close()
    assert "simple v2: pending 1 updated 0 failed 0 rolled back 0" in watch(broker, reports=1)
    r = Reporter(mqtt, "cam-1")
    r.publish({"model": "simple", "version": 2, "state": "idle", "result": "withdrawn"})
    r.close()
    out = watch(broker, "--min-reports", "1", "--halt-at-failure-rate", "0", reports=1)
    last = [line for line in out.splitlines() if line.startswith("simple v2")][-1]
    assert last == (
        "simple v2: pending 0 updated 0 failed 0 rolled back 0 withdrawn 1 "
        "(judged once 1 devices reported: --min-reports; 0 so far)"
    )
    assert "halting" not in out


def test_the_watcher_says_what_it_waits_for(broker: Broker, fleet: Fleet) -> None:
    mqtt = MqttConfig(host="127.0.0.1", port=broker.port, topic_prefix="fleet")
    for d in ("cam-1", "cam-2"):
        r = Reporter(mqtt, d)
        r.publish({"model": "simple", "version": 2, "state": "idle", "result": "rolled_back"})
        r.close()
    out = watch(broker, "--repo", str(fleet.repo), "--keys", str(fleet.keys), reports=2)
    assert "at least 5 devices reported on it (--min-reports)" in out.splitlines()[0]
    assert "judged once 5 devices reported: --min-reports; 2 so far" in out
    assert "halting" not in out


def test_the_broker_acl_lets_a_device_report_only_as_itself(tmp_path: Path) -> None:
    """configs/mosquitto/ota-acl.conf on a real mosquitto: cam-1 (logged in as cam-1)
    cannot publish cam-2's report; the watcher, logged in as fleet-watch, reads cam-1's."""
    binary = require_mosquitto()
    passwd = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
    work = tmp_path / "mq"
    work.mkdir()
    for i, (user, password) in enumerate([("cam-1", "pw1"), ("fleet-watch", "pw2")]):
        flags = ["-b", "-c"] if i == 0 else ["-b"]
        subprocess.run([passwd, *flags, str(work / "passwd"), user, password], check=True)
    acl = work / "acl"
    acl.write_text((ROOT / "configs" / "mosquitto" / "ota-acl.conf").read_text())
    lines = ["allow_anonymous false", f"password_file {work / 'passwd'}", f"acl_file {acl}"]
    broker = Broker(binary, work, extra=lines)
    broker.start()
    try:
        cam1 = MqttConfig(host="127.0.0.1", port=broker.port, username="cam-1", password="pw1")
        for device, result in (("cam-1", "updated"), ("cam-2", "rolled_back")):
            r = Reporter(cam1, device)  # logged in as cam-1 either way
            r.publish({"model": "simple", "version": 3, "state": "idle", "result": result})
            r.close()
        anonymous = MqttConfig(host="127.0.0.1", port=broker.port)
        r = Reporter(anonymous, "cam-3")
        r.publish({"model": "simple", "version": 3, "state": "idle", "result": "rolled_back"})
        r.close()
        out = watch(broker, "--username", "fleet-watch", "--password", "pw2",
                    prefix="appliance", reports=1)  # fmt: skip
        # the broker's own answer (MQTT v5 PUBACK reason codes): 16 "no matching
        # subscribers" is a success, 135 "not authorized" a report it dropped
        assert puback(broker.port, "cam-1", "pw1", "appliance/cam-1/ota") < 128
        assert puback(broker.port, "cam-1", "pw1", "appliance/cam-2/ota") == 135
    finally:
        broker.stop()
    assert "simple v3: pending 0 updated 1 failed 0 rolled back 0" in out


def puback(port: int, user: str, password: str, topic: str) -> int:
    """The reason code of the broker's PUBACK to a QoS 1 publish to ``topic``."""
    acked: queue.Queue[int] = queue.Queue()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{user}-acl", protocol=mqtt.MQTTv5)
    client.username_pw_set(user, password)
    client.on_publish = lambda c, u, mid, reason, props: acked.put(int(reason.value))
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        client.publish(topic, b"{}", qos=1)
        return acked.get(timeout=scaled(30))
    finally:
        client.disconnect()
        client.loop_stop()


def test_signed_reports_keep_fake_ones_from_halting_a_good_release(
    fleet: Fleet, broker: Broker, device: LocalDevice, tmp_path: Path
) -> None:
    mqtt = MqttConfig(host="127.0.0.1", port=broker.port, topic_prefix="fleet")
    agent = device(mqtt=mqtt)
    try:
        fleet.publish(1)
        assert agent.run_once()
    finally:
        agent.close()
    keys = tmp_path / "device-keys"
    keys.mkdir()
    key = devicekey.load(agent.cfg.state_dir, create=False)
    assert key is not None
    (keys / "cam-1.pub").write_text(devicekey.public_text(key) + "\n")
    forger = devicekey.load(tmp_path / "forger")  # a key the fleet does not know
    assert forger is not None
    (keys / "cam-2.pub").write_text(devicekey.public_text(devicekey.load(tmp_path / "c2")) + "\n")
    client = Client(broker.port)
    try:
        for i in range(2, 7):  # five fake failures: unsigned, or signed by the wrong key
            fake = {"model": "simple", "version": 1, "state": "idle", "result": "rolled_back",
                    "time": time.time()}  # fmt: skip
            body = devicekey.sign(fake, forger) if i % 2 else fake
            retain(client, f"fleet/cam-{i}/ota", json.dumps(body).encode())
    finally:
        client.close()
    out = watch(broker, "--device-keys", str(keys), "--min-reports", "1",
                "--halt-at-failure-rate", "0.5", "--repo", str(fleet.repo),
                "--keys", str(fleet.keys), reports=6)  # fmt: skip
    assert "simple v1: pending 0 updated 1 failed 0 rolled back 0" in out
    assert "5 unauthenticated" in out and "halting" not in out
    unsigned = watch(broker, "--min-reports", "1", reports=6)
    assert "rolled back 5" in unsigned  # without keys they would have counted


def test_the_device_listing_shows_what_each_device_runs_and_only_checked_fields() -> None:
    tally = Tally()
    digest = "ab" * 32
    good = {"software": {"version": "1.4.2", "sbom_sha256": digest},
            "current": {"simple": 3, "classifier": 1}}  # fmt: skip
    tally.add("cam-1", good, 100.0)
    hostile = {"software": {"version": "1.4.2\x1b[2J", "sbom_sha256": "zz"},
               "current": {"\x1b]0;owned": 2, "ok": "7", "simple": True}}  # fmt: skip
    tally.add("cam-2", hostile, 90.0)
    tally.add("bad device\x07", good, 95.0)
    assert tally.devices(110.0) == [
        "device ?: software 1.4.2 (SBOM abababababab); models classifier v1, simple v3; "
        "reported 15 s ago",
        "device cam-1: software 1.4.2 (SBOM abababababab); models classifier v1, simple v3; "
        "reported 10 s ago",
        "device cam-2: software ? (SBOM none); models none; reported 20 s ago",
    ]
