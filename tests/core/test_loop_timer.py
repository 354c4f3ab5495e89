"""The loop's microsecond timer (a timerfd the loop watches), on asyncio's loop and on
uvloop, through each way of making one this Python has (os, the C library)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from appliance.core import loop_timer
from appliance.core.loop_timer import LoopTimer

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="timerfd is Linux's")

LIMIT_S = 5.0  # only reached when a test is failing

FACTORIES = {
    "libc": loop_timer._libc_timerfd,
    "os": loop_timer._os_timerfd,
}


def loops() -> list[str]:
    names = ["asyncio"]
    try:
        import uvloop  # noqa: F401

        names.append("uvloop")
    except ImportError:
        pass
    return names


def run_on(loop_name: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    if loop_name == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


@pytest.fixture(params=sorted(FACTORIES))
def factory(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    made = FACTORIES[request.param]()
    if made is None:
        pytest.skip(f"no timerfd through {request.param} on this Python")
    monkeypatch.setattr(loop_timer, "_timerfd", lambda: made)
    return str(request.param)


@pytest.mark.parametrize("loop_name", loops())
def test_it_fires_once_not_before_its_delay_and_again_when_re_armed(
    factory: str, loop_name: str
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fired: list[float] = []
        timer = LoopTimer.create(loop, lambda: fired.append(time.monotonic()))
        assert timer is not None
        for delay_s in (0.0002, 0.02):  # below and above the loop's own timers' grain
            start = time.monotonic()
            timer.arm(delay_s)
            assert timer.armed
            while len(fired) < 1:
                await asyncio.sleep(0.001)
            assert fired[0] - start >= delay_s
            await asyncio.sleep(0.05)
            assert len(fired) == 1 and not timer.armed  # once
            fired.clear()
        timer.close()

    run_on(loop_name, main)


@pytest.mark.parametrize("loop_name", loops())
def test_disarmed_or_closed_it_does_not_fire(factory: str, loop_name: str) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fired: list[str] = []
        timer = LoopTimer.create(loop, lambda: fired.append("fired"))
        assert timer is not None
        timer.arm(0.01)
        timer.disarm()
        assert not timer.armed
        timer.arm(10.0)  # re-armed: the later deadline replaces the first
        await asyncio.sleep(0.1)
        assert fired == []
        timer.arm(0.0001)
        time.sleep(0.01)  # expired while the loop was busy, not yet handled...
        timer.disarm()  # ...and dropped
        await asyncio.sleep(0.05)
        assert fired == []
        fd = timer._fd
        timer.close()
        timer.close()  # (twice is harmless)
        with pytest.raises(OSError):
            os.fstat(fd)  # the descriptor is closed
        await asyncio.sleep(0)

    run_on(loop_name, main)


def test_without_a_timerfd_there_is_no_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop_timer, "_timerfd", lambda: None)

    async def main() -> None:
        assert LoopTimer.create(asyncio.get_running_loop(), lambda: None) is None

    asyncio.run(main())
