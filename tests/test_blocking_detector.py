"""The event-loop detector of the ``run_appliance`` fixture (tests/loop_detector.py): work
and blocking calls on the loop fail a test; a loop merely late on a loaded machine
does not (it waited for a CPU, or for the GIL)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from loop_detector import BlockingDetector

# the thread CPU time of a busy loop is read: alone, beside no other test worker
pytestmark = pytest.mark.serial


def _run_on_a_watched_loop(detector: BlockingDetector, callback: object) -> None:
    loop = asyncio.new_event_loop()
    detector.watch(loop)
    try:
        loop.call_soon(callback)
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        detector.forget(loop, threading.Thread())  # (a thread never started: not alive)
        loop.close()


def _busy_on_the_loop() -> None:
    end = time.thread_time() + 0.3
    while time.thread_time() < end:
        pass


def _sleeping_on_the_loop() -> None:
    time.sleep(0.3)


def test_cpu_work_and_a_blocking_wait_on_the_loop_are_caught() -> None:
    detector = BlockingDetector(cpu_s=0.2, wait_s=0.2)
    _run_on_a_watched_loop(detector, _busy_on_the_loop)
    assert len(detector.slow) == 1 and "_busy_on_the_loop" in detector.slow[0]
    cpu = float(detector.slow[0].split("of which ")[1].split(" s")[0])
    assert 0.3 <= cpu < 0.4  # the thread's CPU time (the busy loop stops at 0.3 s of it)
    _run_on_a_watched_loop(detector, _sleeping_on_the_loop)
    assert len(detector.slow) == 2 and "_sleeping_on_the_loop" in detector.slow[1]
    _run_on_a_watched_loop(detector, lambda: None)  # a quick one is never reported
    assert len(detector.slow) == 2


def test_a_callback_that_only_waited_for_a_cpu_is_not_blocking() -> None:
    detector = BlockingDetector()  # the fixture's thresholds
    assert detector.verdict(wall=3.0, cpu=0.01, waited=2.9) == ""  # load, not the loop
    assert detector.verdict(wall=1.0, cpu=0.6, waited=0.3).startswith("1.00 s, of which 0.60")
    assert "5.49 s blocked" in detector.verdict(wall=6.0, cpu=0.01, waited=0.5)
    assert detector.verdict(wall=4.0, cpu=0.01, waited=0.0) == ""  # a lock held by a late thread
