"""The HTTP front's connection deadline: one loop timer, the latest arming decides.

The loop's clock is the test's (:class:`Clock`): time moves only when a test moves
it, so what is due, and what is not yet, does not depend on the machine's speed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from appliance.adapters.http.deadline import Deadline


class Clock(asyncio.SelectorEventLoop):
    """An event loop whose time is set by the test."""

    now = 1000.0

    def time(self) -> float:
        return self.now


async def advance(seconds: float) -> None:
    """Move the loop's clock, then let it run what became due."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, Clock)
    loop.now += seconds
    for _ in range(3):  # a due timer runs at the next turn; a re-scheduled one after
        await asyncio.sleep(0)


def _run(body: Callable[[Deadline, list[str]], Awaitable[None]]) -> list[str]:
    calls: list[str] = []
    loop = Clock()
    try:
        loop.run_until_complete(body(Deadline(loop), calls))
    finally:
        loop.close()
    return calls


def test_an_armed_deadline_calls_its_callback_once() -> None:
    async def body(d: Deadline, calls: list[str]) -> None:
        d.arm(0.01, lambda: calls.append("late"))
        await advance(0.005)
        calls.append("not yet")
        await advance(0.1)
        await advance(10.0)

    assert _run(body) == ["not yet", "late"]


def test_re_arming_later_moves_the_deadline_and_replaces_the_callback() -> None:
    async def body(d: Deadline, calls: list[str]) -> None:
        d.arm(0.01, lambda: calls.append("first"))
        d.arm(0.2, lambda: calls.append("second"))
        await advance(0.1)
        calls.append("checked")  # the first deadline passed: nothing was called
        await advance(0.3)

    assert _run(body) == ["checked", "second"]


def test_re_arming_earlier_fires_at_the_earlier_deadline() -> None:
    async def body(d: Deadline, calls: list[str]) -> None:
        d.arm(5.0, lambda: calls.append("far"))
        d.arm(0.01, lambda: calls.append("near"))
        await advance(0.2)

    assert _run(body) == ["near"]


def test_disarmed_or_stopped_nothing_is_called() -> None:
    async def body(d: Deadline, calls: list[str]) -> None:
        d.arm(0.01, lambda: calls.append("disarmed"))
        d.disarm()
        await advance(0.1)
        d.arm(0.01, lambda: calls.append("stopped"))
        d.stop()
        await advance(0.1)

    assert _run(body) == []
