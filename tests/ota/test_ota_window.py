"""Maintenance windows as a pure function of the clock the agent trusts (no sleeping:
the times are given), then the agent: it downloads at once and applies only inside a
window (windows set hours away from now, so no test waits on the clock)."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import yaml

from appliance.config.fields import ConfigError
from appliance.ota import OtaError, controls, window
from appliance.ota import config as ota_config
from tests.ota_device import cli
from tests.ota_helpers import Fleet, LocalDevice

BERLIN = ZoneInfo("Europe/Berlin")


def at(text: str, zone: ZoneInfo = BERLIN) -> float:
    """Seconds since the epoch of a local wall-clock time, 'YYYY-MM-DD HH:MM'."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M").replace(tzinfo=zone).timestamp()


def test_weekday_windows_open_and_close_on_the_local_clock() -> None:
    w = window.parse(["Mon-Fri 02:00-04:00", "Sat,Sun 01:00-06:00"], "Europe/Berlin")
    # 2026-12-07 is a Monday
    assert not w.is_open(at("2026-12-07 01:59"))
    assert w.is_open(at("2026-12-07 02:00")) and w.is_open(at("2026-12-07 03:59"))
    assert not w.is_open(at("2026-12-07 04:00"))
    assert w.is_open(at("2026-12-12 05:30"))  # Saturday
    assert not w.is_open(at("2026-12-11 05:30"))  # Friday
    assert w.next_open(at("2026-12-07 04:00")) == at("2026-12-08 02:00")
    assert w.next_open(at("2026-12-11 04:30")) == at("2026-12-12 01:00")
    assert w.next_open(at("2026-12-07 03:00")) == at("2026-12-07 03:00")  # open now


def test_a_window_across_midnight_and_a_whole_day() -> None:
    w = window.parse(["Fri 23:30-00:30"], "UTC")
    utc = ZoneInfo("UTC")
    assert w.is_open(at("2026-12-11 23:45", utc)) and w.is_open(at("2026-12-12 00:15", utc))
    assert not w.is_open(at("2026-12-12 00:30", utc)) and not w.is_open(at("2026-12-10 23:45", utc))
    day = window.parse(["sunday 00:00-24:00"], "UTC")
    assert day.is_open(at("2026-12-13 00:00", utc)) and day.is_open(at("2026-12-13 23:59", utc))
    assert not day.is_open(at("2026-12-14 00:00", utc))
    assert window.parse([]).is_open(0.0)  # no windows: always


def test_daylight_saving_follows_the_wall_clock() -> None:
    w = window.parse(["daily 02:30-03:30"], "Europe/Berlin")
    # 2027-03-28: clocks go from 02:00 to 03:00; the window's last half hour is left
    assert w.is_open(at("2027-03-28 03:10")) and not w.is_open(at("2027-03-28 03:40"))
    assert w.next_open(at("2027-03-27 12:00")) == at("2027-03-28 03:00")  # where the gap ends


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("Mon-Fri 2:00-4:00", "expected '[days ]HH:MM-HH:MM'"),
        ("Funday 02:00-04:00", "'funday' is not a day"),
        ("Mon 24:00-01:00", "24:00 is not a time of day"),
        ("Mon 01:60-02:00", "01:60 is not a time of day"),
        ("Mon 02:00-02:00", "opens and closes at the same time"),
    ],
)
def test_a_bad_window_is_named(spec: str, expected: str) -> None:
    with pytest.raises(OtaError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        window.parse([spec])


def test_an_unknown_time_zone_is_named() -> None:
    with pytest.raises(OtaError, match="'Mars/Olympus' is not a time zone"):
        window.parse(["daily 01:00-02:00"], "Mars/Olympus")


def _span(start_h: float, hours: float = 1.0) -> str:
    """A daily window in UTC opening ``start_h`` hours from now, ``hours`` long."""
    now = time.time()
    a, b = (time.gmtime(now + start_h * 3600), time.gmtime(now + (start_h + hours) * 3600))
    return f"daily {a.tm_hour:02d}:{a.tm_min:02d}-{b.tm_hour:02d}:{b.tm_min:02d}"


def test_an_update_downloads_at_once_and_waits_for_its_window(
    fleet: Fleet, device: LocalDevice
) -> None:
    fleet.publish(1)
    assert device().run_once()
    fleet.publish(2)
    closed = (_span(6),)
    for _ in range(4):  # each cycle re-checks the job, never counted as a crash
        agent = device(maintenance_windows=closed)
        assert agent.run_once(), agent.state.last_error
        job = agent.state.job
        assert agent.state.phase == "waiting" and job is not None and job.version == 2
        assert agent.ctx.bundle_path(job).exists()  # downloaded and verified already
        assert time.time() + 5 * 3600 < job.window_opens < time.time() + 7 * 3600
        assert agent.state.next_check <= job.window_opens + 1
        assert device.serving() == "1" and not (device.models / "simple" / "2").exists()
    config = device.state_dir.parent / "appliance.yaml"
    config.write_text(yaml.safe_dump({"model_repository": str(device.models), "ota": {
        "source": fleet.server.url, "trusted_root": str(fleet.repo / "metadata" / "1.root.json"),
        "state_dir": str(device.state_dir), "maintenance_windows": list(closed)}}))  # fmt: skip
    status = json.loads(cli("ota", "status", "--config", str(config)))
    assert status["phase"] == "waiting" and 5 * 3600 < status["window_opens_in_s"] < 7 * 3600
    agent = device(maintenance_windows=(_span(-0.5),))  # open now
    assert agent.run_once(), agent.state.last_error
    assert agent.state.history[-1]["result"] == "updated" and device.serving() == "2"


def test_a_job_withdrawn_while_it_waits_is_dropped(fleet: Fleet, device: LocalDevice) -> None:
    fleet.publish(1)
    assert device().run_once()
    fleet.publish(2)
    agent = device(maintenance_windows=(_span(6),))
    assert agent.run_once() and agent.state.phase == "waiting"
    controls.set_rollout(fleet.repo, fleet.keys, "simple", 2, None, True)  # halted
    agent = device(maintenance_windows=(_span(6),))
    agent.run_once()
    assert agent.state.job is None and agent.state.history[-1]["result"] == "withdrawn"
    assert 2 not in agent.state.models["simple"].bad and device.serving() == "1"


def test_the_config_names_a_bad_window(tmp_path: Path) -> None:
    root = tmp_path / "root.json"
    root.write_text("{}")
    path = tmp_path / "appliance.yaml"
    for ota, expected in (
        ({"maintenance_windows": "02:00-04:00"}, "expected a list"),
        ({"maintenance_windows": ["Mon 2-4"]}, "expected '[days ]HH:MM-HH:MM'"),
        ({"maintenance_windows": ["02:00-04:00"], "maintenance_timezone": "Mars/Olympus"},
         "not a time zone"),
    ):  # fmt: skip
        base = {"source": "http://127.0.0.1:1/", "trusted_root": str(root)}
        doc = {"model_repository": str(tmp_path), "ota": {**base, **ota}}
        path.write_text(yaml.safe_dump(doc))
        with pytest.raises(ConfigError, match=re.escape(expected)):
            ota_config.load(path)
    doc["ota"] = {**doc["ota"], "maintenance_timezone": "Europe/Berlin"}  # type: ignore[dict-item]
    path.write_text(yaml.safe_dump(doc))
    cfg = ota_config.load(path)
    assert cfg.maintenance_windows == ("02:00-04:00",) and not cfg.windows().is_open(
        at("2026-12-07 04:30")
    )
