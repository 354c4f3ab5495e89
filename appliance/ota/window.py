"""Maintenance windows: when a device may apply an update it has downloaded.

A device downloads and verifies an update whenever one is offered, but starts
applying it (stage, load, self-test, shadow, switch, probation, commit) only while
one of its windows is open; once started, an update runs to its end, even past the
window's close, since stopping half-way would be one more switch. Windows are
given as ``ota.maintenance_windows`` in the device's local wall-clock time of
``ota.maintenance_timezone`` (an IANA name such as ``Europe/Berlin``, default
``UTC``), one string each::

    "Mon-Fri 02:00-04:00"   weekdays, two hours
    "Sat,Sun 01:00-06:00"   a list of days
    "daily 23:30-00:30"     crossing midnight: it closes the next day
    "Sun 00:00-24:00"       a whole day

No windows: always open. The clock is the one the agent trusts for metadata
expiry (:mod:`appliance.ota.agent`): while the agent refuses its clock, it applies nothing,
so a clock that jumped cannot open a window early. Daylight-saving changes follow
the wall clock (a 02:00-03:00 window is skipped on the night 02:00 does not exist).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, time, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from appliance.ota import OtaError

_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_SPEC = re.compile(r"^\s*(?:(?P<days>[A-Za-z,\-]+)\s+)?(?P<start>\d\d:\d\d)-(?P<end>\d\d:\d\d)\s*$")


@dataclass(frozen=True, slots=True)
class Span:
    days: frozenset[int]  # weekdays it opens on, Monday 0
    start: int  # minutes after midnight
    end: int  # minutes after midnight, 1440 at most; <= start: closes the next day


def _minutes(text: str, spec: str, end: bool) -> int:
    hours, minutes = int(text[:2]), int(text[3:])
    value = hours * 60 + minutes
    if minutes > 59 or value > (1440 if end else 1439):
        raise OtaError(f"maintenance window {spec!r}: {text} is not a time of day")
    return value


_NAMES = {
    **{d: i for i, d in enumerate(_DAYS)},
    **{d: i for i, d in enumerate(("monday", "tuesday", "wednesday", "thursday", "friday",
                                   "saturday", "sunday"))},
}  # fmt: skip


def _days(text: str | None, spec: str) -> frozenset[int]:
    if text is None or text.lower() == "daily":
        return frozenset(range(7))
    out: set[int] = set()
    for part in text.lower().split(","):
        first, _, last = part.partition("-")
        a, b = _NAMES.get(first), _NAMES.get(last or first)
        if a is None or b is None:
            raise OtaError(f"maintenance window {spec!r}: {part!r} is not a day (Mon..Sun, daily)")
        out.update((a + i) % 7 for i in range((b - a) % 7 + 1))
    return frozenset(out)


def parse_span(spec: str) -> Span:
    m = _SPEC.match(spec) if isinstance(spec, str) else None
    if m is None:
        raise OtaError(
            f"maintenance window {spec!r}: expected '[days ]HH:MM-HH:MM', "
            "e.g. 'Mon-Fri 02:00-04:00'"
        )
    start = _minutes(m["start"], spec, end=False)
    end = _minutes(m["end"], spec, end=True)
    if start == end:
        raise OtaError(f"maintenance window {spec!r}: it opens and closes at the same time")
    return Span(_days(m["days"], spec), start, end)


@dataclass(frozen=True, slots=True)
class Windows:
    spans: tuple[Span, ...]
    zone: ZoneInfo

    def _local(self, now: float) -> datetime:
        return datetime.fromtimestamp(now, self.zone)

    def is_open(self, now: float) -> bool:
        """Whether a window is open at ``now`` (seconds since the epoch)."""
        if not self.spans:
            return True
        local = self._local(now)
        minute = local.hour * 60 + local.minute
        today, yesterday = local.weekday(), (local.weekday() - 1) % 7
        for s in self.spans:
            if s.end > s.start:
                if today in s.days and s.start <= minute < s.end:
                    return True
            elif (today in s.days and minute >= s.start) or (
                yesterday in s.days and minute < s.end
            ):
                return True
        return False

    def _first_open(self, opens: datetime) -> float:
        """The first instant a window opening at the wall-clock time ``opens`` is open:
        that time (its first occurrence when the clock falls back), or, where a
        daylight-saving gap swallowed it, the gap's end."""
        early = opens.replace(tzinfo=self.zone, fold=1).timestamp()
        late = opens.replace(tzinfo=self.zone, fold=0).timestamp()
        at, last = min(early, late), max(early, late)
        while at < last and not self.is_open(at):  # only in a gap: a minute a step
            at += 60
        return at

    def next_open(self, now: float) -> float:
        """When a window is next open (``now`` while one is)."""
        if self.is_open(now):
            return now
        local = self._local(now)
        best: float | None = None
        for offset in range(8):
            day = (local + timedelta(days=offset)).date()
            for s in self.spans:
                if day.weekday() not in s.days:
                    continue
                at = self._first_open(datetime.combine(day, time(s.start // 60, s.start % 60)))
                if at > now and (best is None or at < best):
                    best = at
        return best if best is not None else now


def parse(specs: list[str] | tuple[str, ...], timezone: str = "UTC") -> Windows:
    """The windows of ``ota.maintenance_windows``; OtaError naming a bad one."""
    try:
        zone = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise OtaError(
            f"maintenance_timezone {timezone!r} is not a time zone this system knows (an IANA "
            "name such as Europe/Berlin; install tzdata if none are known)"
        ) from None
    return Windows(tuple(parse_span(s) for s in specs), zone)
