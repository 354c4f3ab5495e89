"""The OTA agent under systemd (Type=notify): READY=1 once it has read its config and
state, WATCHDOG=1 while it is alive (here: failing its checks against a source that is
down, and waiting for the next one), STOPPING=1 and exit 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from ota_helpers import start_fleet
from sd_listener import Listener

ROOT = Path(__file__).resolve().parents[2]


def test_the_agent_notifies_systemd_and_pings_its_watchdog(
    listener: Listener, tmp_path: Path
) -> None:
    fleet = start_fleet(tmp_path / "fleet")
    source = fleet.server.url
    fleet.server.stop()  # the update source is down: every check fails, the agent lives on
    models = tmp_path / "models"
    models.mkdir()
    config = tmp_path / "appliance.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model_repository": str(models),
                "ota": {
                    "source": source,
                    "trusted_root": str(fleet.repo / "metadata" / "1.root.json"),
                    "state_dir": str(tmp_path / "state"),
                    "device_id": "cam-1",
                    "check_interval_s": 0.2,
                    "jitter": 0,
                },
            }
        )
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "NOTIFY_SOCKET": listener.sock.getsockname(),
        "WATCHDOG_USEC": "400000",  # a ping every 0.2 s
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "appliance", "ota", "agent", "--config", str(config)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        listener.until("READY", "1")
        assert listener.messages[0]["STATUS"].startswith(f"checking {source}")
        listener.until("WATCHDOG", "1", at_least=3)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    listener.until("STOPPING", "1")
    assert proc.returncode == 0, err
    assert "ota: check:" in err  # it did check, and failed, and carried on
