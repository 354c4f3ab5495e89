"""Mirrors that misbehave, and disks that fill up: the agent is never stuck.

A cache answering ``206`` from byte 0 to a Range request, a mirror that trickles,
a job that outlives its deadline, a full file system (a real tmpfs of a few MiB, by
bytes and by inodes). Each ends in a one-line reason, nothing half-written, and an
agent that goes on by itself once the mirror or the disk is fine again.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance.config.mqtt_config import MqttConfig
from tests.mosquitto import Broker
from tests.ota_helpers import Fleet, LocalDevice, files_under, retained_report


def bundle_requests(fleet: Fleet) -> list[str]:
    return [r for p, r in fleet.server.requests if p.endswith(".bundle")]


def test_a_range_answered_from_byte_zero_falls_back_to_a_full_download(
    fleet: Fleet, device: LocalDevice
) -> None:
    fleet.publish(1)
    agent = device()
    assert agent.run_once()
    path = fleet.publish(2, pad=64 << 10)
    half = path.stat().st_size // 2
    fleet.server.cut_after = half
    assert not agent.run_once() and "interrupted" in agent.state.last_error
    fleet.server.broken_range = True  # 206, Content-Range "bytes 0-...": the whole file
    assert agent.run_once(), agent.state.last_error
    assert device.serving() == "2"
    # the resume was asked for, noticed to start at 0, and replaced by a whole download
    assert bundle_requests(fleet)[-3:] == ["", f"bytes={half}-", ""]


def test_a_lying_mirror_costs_one_restart_then_backs_off_and_recovers(
    fleet: Fleet, device: LocalDevice
) -> None:
    """The field report: a download cut, then a cache whose 206 promises the rest but
    sends the whole file. The agent restarts from byte 0 once and completes; a mirror
    that serves wrong bytes even from byte 0 keeps the job, backs off, keeps nothing."""
    fleet.publish(1)
    agent = device()
    assert agent.run_once()
    path = fleet.publish(2, pad=64 << 10)
    half = path.stat().st_size // 2
    fleet.server.cut_after = half
    assert not agent.run_once() and "interrupted" in agent.state.last_error
    fleet.server.lie = "long"
    assert agent.run_once(), agent.state.last_error
    assert device.serving() == "2"
    assert bundle_requests(fleet)[-3:] == ["", f"bytes={half}-", ""]
    fleet.server.lie = ""
    fleet.publish(3)
    fleet.server.corrupt = True
    for retries in (1, 2):  # every cycle the same: one download from 0, then a back-off
        assert not agent.run_once()
        assert "the mirror is at fault" in agent.state.last_error
        assert agent.state.job is not None and agent.state.retries == retries
        assert not any((agent.cfg.state_dir / "downloads").iterdir())
        assert agent.state.models["simple"].bad == []
    assert bundle_requests(fleet)[-2:] == ["", ""]
    assert device.serving() == "2"
    fleet.server.corrupt = False
    assert agent.run_once(), agent.state.last_error
    assert device.serving() == "3"


def test_a_trickling_mirror_ends_the_attempt_and_the_download_resumes(
    fleet: Fleet, device: LocalDevice
) -> None:
    fleet.publish(1)
    agent = device(min_download_rate=8192, download_rate_window_s=0.5)
    assert agent.run_once()
    fleet.publish(2, pad=16 << 10)
    fleet.server.trickle = 32  # 320 bytes/s, far below the minimum of 8 KiB/s
    assert not agent.run_once()
    assert "below the minimum" in agent.state.last_error
    assert agent.state.phase == "download" and agent.state.job is not None  # kept
    part = next((agent.cfg.state_dir / "downloads").glob("*.part"))
    kept = part.stat().st_size
    assert kept > 0
    fleet.server.trickle = 0
    agent = device()  # (the default minimum: a loaded machine may pause half a second)
    assert agent.run_once(), agent.state.last_error
    assert device.serving() == "2"
    assert bundle_requests(fleet)[-1] == f"bytes={kept}-"  # resumed where it stopped


def test_a_job_past_its_deadline_is_dropped_and_taken_again(
    fleet: Fleet, device: LocalDevice
) -> None:
    fleet.publish(1)
    agent = device(min_download_rate=0, job_deadline_s=1.0)
    assert agent.run_once()
    fleet.publish(2, pad=16 << 10)
    fleet.server.trickle = 32  # the 16 KiB take about 50 s: far past the deadline
    assert not agent.run_once()
    assert "deadline" in agent.state.last_error and agent.state.job is None
    assert agent.state.models["simple"].bad == []  # the mirror was slow, not the bundle
    assert not any((agent.cfg.state_dir / "downloads").iterdir())
    fleet.server.trickle = 0
    agent = device(min_download_rate=0)  # the default deadline: not a race with the load
    assert agent.run_once(), agent.state.last_error  # a new job, taken again
    assert device.serving() == "2"


def test_a_full_disk_is_refused_before_download_and_recovered_from(
    fleet: Fleet,
    device_on: Callable[[Path, Path], LocalDevice],
    tmpfs: Callable[..., Path],
    broker: Broker,
) -> None:
    disk = tmpfs("disk", size="4m")
    device = device_on(disk / "models", disk / "state")
    mqtt = MqttConfig(host="127.0.0.1", port=broker.port, topic_prefix="fleet")
    agent = device(reserve_disk=64 << 10, mqtt=mqtt)
    try:
        fleet.publish(1)
        assert agent.run_once()
        fleet.publish(2, pad=1 << 20)  # 1 MiB unpacked, as much again to download
        filler = disk / "filler"
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        filler.write_bytes(b"\0" * (free - (1 << 20)))  # 1 MiB left: not enough for 2 MiB
        before = files_under(disk / "models")
        assert not agent.run_once()
        reason = agent.state.last_error
        assert "not enough disk space" in reason and "\n" not in reason
        assert files_under(disk / "models") == before  # nothing staged
        assert not list((disk / "state" / "downloads").glob("*"))  # nothing downloaded
        assert device.serving() == "1"
        assert "not enough disk space" in retained_report(broker.port, "cam-1")["error"]
        filler.unlink()  # space comes back: the agent goes on by itself
        assert agent.run_once(), agent.state.last_error
        assert device.serving() == "2"
    finally:
        agent.close()


@pytest.mark.parametrize("full", ["state", "models"])
def test_writes_that_fail_on_a_full_disk_leave_no_traceback_and_recover(
    fleet: Fleet,
    device_on: Callable[[Path, Path], LocalDevice],
    tmpfs: Callable[..., Path],
    tmp_path: Path,
    full: str,
) -> None:
    """Out of inodes: free bytes remain (so every size check passes) but no file can
    be created, so the writes themselves fail with ENOSPC: the state file's (the
    state folder full) or the staging's (the model repository full)."""
    disk = tmpfs("disk", size="8m", inodes=64)
    models = disk / "models" if full == "models" else tmp_path / "models"
    state = disk / "state" if full == "state" else tmp_path / "state"
    device = device_on(models, state)
    agent = device(reserve_disk=0)
    fleet.publish(1)
    assert agent.run_once()
    fleet.publish(2)
    fillers = disk / "fillers"
    fillers.mkdir()
    for i in range(1000):  # bounded: 64 inodes in all
        try:
            (fillers / str(i)).touch()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            break
    for _ in range(2):  # every cycle the same: a reason, not a crash
        assert not agent.run_once()
        assert "No space left on device" in agent.state.last_error, agent.state.last_error
        assert device.serving() == "1"
    assert not (models / ".ota-staging").exists() or not any((models / ".ota-staging").iterdir())
    for f in fillers.iterdir():
        f.unlink()
    assert agent.run_once(), agent.state.last_error
    assert device.serving() == "2"
