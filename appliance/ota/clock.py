"""The clock rule: when the device's clock may be trusted to judge metadata expiry.

Expiry is what stops a frozen or replayed repository, and it needs the wall
clock. A device without a real-time clock boots at some old time until NTP sets
it, and with the clock behind, expired metadata would look valid. So the agent
keeps ``clock_floor``, a time it knows has passed, and does not check for updates
while the clock is more than :data:`SLACK_S` behind it ("waiting for the clock").

The floor only ever holds a time that both the clock and the repository vouched
for: it advances after a refresh in which ngclient verified every role as
unexpired, to ``min(now, timestamp expiry - TIMESTAMP_LIFETIME)``. The fleet signs
each timestamp for :data:`TIMESTAMP_LIFETIME` (``appliance fleet refresh``), so
that bound is when the timestamp was signed, a time that has really passed. A
clock that runs ahead therefore never drags the floor into the future: far ahead,
the metadata looks expired and the floor does not move at all; a little ahead, the
floor stops at the signing time. Once the clock is set right again the device
updates at once; it never waits for a time it only imagined. A clock behind is
still caught, which is what the floor is for.
"""

from __future__ import annotations

from datetime import datetime, timedelta

SLACK_S = 300.0
TIMESTAMP_LIFETIME = timedelta(days=1)  # what `appliance fleet refresh` signs for


def behind(floor: float, now: float) -> str:
    """Why the clock cannot be trusted now ("" when it can)."""
    if now >= floor - SLACK_S:
        return ""
    return (
        f"the clock ({datetime.fromtimestamp(now).isoformat(timespec='seconds')}) is "
        f"behind a time this device has already seen "
        f"({datetime.fromtimestamp(floor).isoformat(timespec='seconds')}); waiting for it "
        "to be set (NTP) before trusting metadata expiry"
    )


def vouched(floor: float, now: float, timestamp_expires: datetime) -> float:
    """The floor after a refresh verified at ``now``."""
    signed_at = (timestamp_expires - TIMESTAMP_LIFETIME).timestamp()
    return max(floor, min(now, signed_at))
