"""systemd: the unit files verify, and the real server speaks the notify protocol.

The server is started as ``python -m appliance serve`` with a ``NOTIFY_SOCKET`` this
test listens on (a datagram socket in a temporary folder), as systemd would start it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from mosquitto import free_port
from sd_listener import Listener

from appliance.sdnotify import Notifier, SystemdLink, socket_address, watchdog_interval
from devtools import modelgen

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "systemd"
CURRENT = "/var/lib/appliance/ota/software/current/bin/appliance"  # the A/B link (docs/ota.md)


# ---- unit files -------------------------------------------------------------------


def _verify(unit: Path, text: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: systemd)")
    # verify checks that ExecStart's program exists: point it at a stand-in
    stand_in = tmp / "appliance"
    stand_in.write_text("#!/bin/sh\n")
    stand_in.chmod(0o755)
    copy = tmp / unit.name
    for program in ("/opt/appliance/venv/bin/appliance", CURRENT):
        text = text.replace(program, str(stand_in))
    copy.write_text(text)
    return subprocess.run(
        [analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "name", ["appliance.service", "appliance-ota.service", "appliance-ota-rescue.service"]
)
def test_units_verify_cleanly(name: str, tmp_path: Path) -> None:
    unit = UNITS / name
    done = _verify(unit, unit.read_text(), tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr  # warnings count too


@pytest.mark.parametrize(
    "name",
    [
        "appliance.service.d/jetson-gpu.conf",
        "appliance.service.d/model-key.conf",
        "appliance.service.d/ab.conf",
        "appliance-ota.service.d/ab.conf",
    ],
)
def test_each_drop_in_verifies_on_top_of_the_unit(name: str, tmp_path: Path) -> None:
    unit = UNITS / name.split(".d/")[0]
    drop_in = (UNITS / name).read_text()
    done = _verify(unit, unit.read_text() + "\n" + drop_in, tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_the_unit_asks_for_what_the_server_provides() -> None:
    text = (UNITS / "appliance.service").read_text()
    settings = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and line[0] != "#"
    )
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    assert int(settings["WatchdogSec"]) > 0 and settings["Restart"] == "on-failure"
    assert settings["User"] == "appliance" and settings["ProtectSystem"] == "strict"
    assert settings["NoNewPrivileges"] == "yes" and "MemoryMax" in settings
    assert settings["ExecStart"].split()[1:3] == ["serve", "--config"]
    sysusers = (UNITS / "appliance.sysusers").read_text()
    assert "u appliance " in sysusers


def test_the_agent_unit_pulls_in_the_server_and_starts_after_it() -> None:
    """Ordered after the server and pulling it in (Wants=), never bound to it: a server
    that restarts must not stop the agent, which waits for it before a load."""
    text = (UNITS / "appliance-ota.service").read_text()
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and line[0] != "#":
            key, value = line.split("=", 1)
            settings.setdefault(key, []).extend(value.split())
    assert "appliance.service" in settings["After"]
    assert "appliance.service" in settings["Wants"]
    assert "appliance.service" not in settings.get("BindsTo", []) + settings.get("Requires", [])


# ---- the notify protocol ----------------------------------------------------------


def test_addresses_and_watchdog_interval() -> None:
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("@sd-notify") == "\0sd-notify"
    assert socket_address("vsock:2:1234") is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "x"}) is None


def test_outside_systemd_nothing_is_sent() -> None:
    notifier = Notifier({})
    assert not notifier.enabled and notifier.notify("READY=1") is False
    link = SystemdLink(lambda: True, lambda: "", notifier)
    link.start()  # no loop needed: nothing is started
    assert link.sent_ready is False


def test_an_abstract_socket_name_is_reached() -> None:
    name = f"appliance-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(10)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).notify("READY=1", "STATUS=x")
        assert sock.recv(4096) == b"READY=1\nSTATUS=x"


def _http(port: int, path: str, body: dict[str, object] | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_ready_only_once_the_models_are_watchdog_pings_and_stopping(
    listener: Listener, tmp_path: Path
) -> None:
    modelgen.write_model(tmp_path, "good", modelgen.simple_add_sub())
    broken = modelgen.write_model(tmp_path, "late", modelgen.simple_add_sub(), "max_batch_size: x")
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "NOTIFY_SOCKET": listener.sock.getsockname(),
        "WATCHDOG_USEC": "200000",  # a ping every 0.1 s
    }
    args = ["--http-port", str(port), "--grpc-port", "-1", "--metrics-port", "-1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "appliance", "serve", "--model-repository", str(tmp_path), *args],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # 'late' failed: pings come (the loop runs), READY=1 does not
        listener.until("WATCHDOG", "1", at_least=3)
        assert listener.count("READY", "1") == 0
        assert _http(port, "/v2/health/ready") == 400
        assert any("not ready" in m.get("STATUS", "") for m in listener.messages)

        # once every model asked for is READY, systemd hears it
        (broken / "config.yaml").unlink()
        assert _http(port, "/v2/repository/models/late/load", {}) == 200
        listener.until("READY", "1")
        assert _http(port, "/v2/health/ready") == 200
        ready_at = next(i for i, m in enumerate(listener.messages) if m.get("READY") == "1")
        assert listener.messages[ready_at]["STATUS"].startswith("serving ")

        # the watchdog keeps pinging after READY, and READY is said once
        pings = listener.count("WATCHDOG", "1")
        listener.until("WATCHDOG", "1", at_least=pings + 2)
        assert listener.count("READY", "1") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    listener.until("STOPPING", "1")
    assert proc.returncode == 0, err
