"""Trace and log settings: validation, rate and count, per-model overrides (no server)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from appliance.core.log_settings import LogSettings
from appliance.core.trace import DEFAULTS, Tracer
from appliance.errors import ApplianceError


def test_rate_and_count_decide_which_requests_are_traced(tmp_path: Path) -> None:
    tracer = Tracer(tmp_path / "t.json")
    assert not tracer.active and tracer.begin("m", 0) is None
    tracer.update({"trace_level": ["TIMESTAMPS"], "trace_rate": 3, "trace_count": "2"})
    assert tracer.active
    picked = [tracer.begin("m", i) is not None for i in range(9)]
    assert picked == [False, False, True, False, False, True, False, False, False]
    assert tracer.settings()["trace_count"] == "0"


def test_model_settings_override_and_fall_back(tmp_path: Path) -> None:
    tracer = Tracer(tmp_path / "t.json")
    tracer.update({"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    assert tracer.update({"trace_level": ["OFF"]}, "quiet")["trace_level"] == ["OFF"]
    assert tracer.begin("quiet", 0) is None and tracer.begin("loud", 0) is not None
    assert tracer.update({"trace_level": None}, "quiet")["trace_level"] == ["TIMESTAMPS"]
    assert tracer.begin("quiet", 0) is not None


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"trace_level": ["TENSORS"]}, "TENSORS is not supported"),
        ({"trace_level": ["LOUD"]}, "unknown trace_level"),
        ({"trace_rate": "0"}, "trace_rate must be >= 1"),
        ({"trace_count": "x"}, "trace_count must be an integer"),
        ({"trace_file": "/etc/passwd"}, "cannot be changed through the network"),
        ({"trace_mode": "opentelemetry"}, "not supported"),
        ({"colour": "red"}, "unknown trace setting"),
        ({"colour": None}, "unknown trace setting"),
    ],
)
def test_bad_trace_settings_are_refused(tmp_path: Path, changes: dict, words: str) -> None:
    tracer = Tracer(tmp_path / "t.json")
    before = tracer.settings()
    with pytest.raises(ApplianceError, match=words):
        tracer.update(changes)
    assert tracer.settings() == before


def test_a_cleared_server_setting_goes_back_to_its_default(tmp_path: Path) -> None:
    tracer = Tracer(tmp_path / "t.json")
    tracer.update({"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "5"})
    settings = tracer.update({"trace_rate": None, "trace_level": [], "trace_count": None})
    assert settings == {**DEFAULTS, "trace_file": str(tmp_path / "t.json")}
    assert not tracer.active


def test_tracing_without_a_file_is_refused() -> None:
    tracer = Tracer(None)
    with pytest.raises(ApplianceError, match="trace_file in the server config"):
        tracer.update({"trace_level": ["TIMESTAMPS"]})
    assert not tracer.active and tracer.settings()["trace_level"] == ["OFF"]


def test_log_settings_map_to_levels() -> None:
    root = logging.getLogger()
    before = root.level
    try:
        settings = LogSettings("warning")
        assert settings.settings()["log_info"] is False
        assert settings.update({"log_info": True})["log_info"] is True
        assert root.level == logging.INFO
        settings.update({"log_info": False, "log_warning": False})
        assert root.level == logging.ERROR
        with pytest.raises(ApplianceError, match="log_verbose_level"):
            settings.update({"log_verbose_level": -1, "log_info": True})
        assert settings.settings()["log_info"] is False  # nothing of a refused change applied
    finally:
        root.setLevel(before)


def test_log_format_iso8601_stamps_each_line_in_utc_and_default_restores() -> None:
    root = logging.getLogger()
    handler = logging.StreamHandler()
    started = logging.Formatter("%(message)s")
    handler.setFormatter(started)
    root.addHandler(handler)
    try:
        settings = LogSettings("info")
        assert settings.update({"log_format": "ISO8601"})["log_format"] == "ISO8601"
        record = logging.LogRecord("x", logging.INFO, "f", 1, "hello", None, None)
        record.created = 0.0
        assert handler.format(record).startswith("1970-01-01T00:00:00Z INFO x: hello")
        settings.update({"log_format": "default"})
        assert handler.formatter is started
        with pytest.raises(ApplianceError, match="expected 'default' or 'ISO8601'"):
            settings.update({"log_format": "json"})
    finally:
        root.removeHandler(handler)
