"""How much slower than native this machine runs the suite, for the bounds of waits.

``APPLIANCE_TEST_SLOWDOWN`` (default 1) multiplies the bounded waits of the end-to-end
tests and the blocking detector's threshold: ``scripts/arm64-check.sh`` sets it for a
chroot under qemu-user emulation, where every step takes many times as long. No test
asserts a duration; this only keeps a bound meant to stop a hang from firing first.
"""

from __future__ import annotations

import os

SLOWDOWN = max(1.0, float(os.environ.get("APPLIANCE_TEST_SLOWDOWN", "1") or "1"))


def scaled(seconds: float) -> float:
    """``seconds`` on this machine."""
    return seconds * SLOWDOWN
