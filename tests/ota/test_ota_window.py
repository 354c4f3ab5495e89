"""Maintenance windows as a pure function of the clock the agent trusts (no sleeping:
the times are given)."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from ota import OtaError, window

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
