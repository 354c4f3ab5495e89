"""The HTTP front's connection deadline: one loop timer, the latest arming decides."""

from __future__ import annotations

import asyncio

from appliance.adapters.http.deadline import Deadline


def _run(body) -> list[str]:  # type: ignore[no-untyped-def]
    calls: list[str] = []

    async def main() -> None:
        await body(Deadline(asyncio.get_running_loop()), calls)

    asyncio.run(main())
    return calls


def test_an_armed_deadline_calls_its_callback_once() -> None:
    async def body(d: Deadline, calls: list[str]) -> None:
        d.arm(0.01, lambda: calls.append("late"))
        await asyncio.sleep(0.1)

    assert _run(body) == ["late"]


def test_re_arming_later_moves_the_deadline_and_replaces_the_callback() -> None:
    async def body(d: Deadline, calls: list[str]) -> None:
        d.arm(0.01, lambda: calls.append("first"))
        d.arm(0.2, lambda: calls.append("second"))
        await asyncio.sleep(0.1)
        calls.append("checked")  # the first deadline passed: nothing was called
        await asyncio.sleep(0.3)

    assert _run(body) == ["checked", "second"]


def test_re_arming_earlier_fires_at_the_earlier_deadline() -> None:
    async def body(d: Deadline, calls: list[str]) -> None:
        d.arm(5.0, lambda: calls.append("far"))
        d.arm(0.01, lambda: calls.append("near"))
        await asyncio.sleep(0.2)

    assert _run(body) == ["near"]


def test_disarmed_or_stopped_nothing_is_called() -> None:
    async def body(d: Deadline, calls: list[str]) -> None:
        d.arm(0.01, lambda: calls.append("disarmed"))
        d.disarm()
        await asyncio.sleep(0.1)
        d.arm(0.01, lambda: calls.append("stopped"))
        d.stop()
        await asyncio.sleep(0.1)

    assert _run(body) == []
