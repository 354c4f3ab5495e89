"""When a broken model is loaded again (core/recovery.py): at once, then with a
doubling back-off up to five minutes, and from the first step again once it stayed
whole for a minute. Pure bookkeeping with the times given; the end-to-end case (an
isolated Python model whose instance gave up, loaded again with no one asking) is in
tests/backends/test_process_isolation.py."""

from __future__ import annotations

import itertools

from appliance.core.recovery import FIRST_S, LONGEST_S, STEADY_S, Recovery


def test_a_broken_model_is_loaded_again_at_once_then_with_a_doubling_back_off() -> None:
    r = Recovery()
    assert not r.due("m", broken=False, now=0.0)
    assert r.due("m", broken=True, now=10.0)  # at once
    assert not r.due("m", broken=True, now=10.0 + FIRST_S / 2)
    assert r.due("m", broken=True, now=10.0 + FIRST_S)
    times, now = [], 10.0 + FIRST_S
    for _ in range(12):  # broken at every start: the waits double, up to the longest
        while not r.due("m", broken=True, now=now):
            now += 0.25
        times.append(now)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps[0] == 4 * FIRST_S and gaps[1] == 2 * gaps[0]  # (1 s, 2 s before them)
    assert max(gaps) == LONGEST_S and gaps[-1] == LONGEST_S
    assert r.tries("m") == 14


def test_a_model_whole_for_a_minute_starts_over_and_others_are_apart() -> None:
    r = Recovery()
    assert r.due("m", broken=True, now=0.0) and r.due("m", broken=True, now=FIRST_S)
    assert not r.due("m", broken=False, now=FIRST_S + STEADY_S / 2)
    assert r.tries("m") == 2  # not long enough whole
    assert not r.due("m", broken=False, now=FIRST_S + STEADY_S)
    assert r.tries("m") == 0
    assert r.due("m", broken=True, now=FIRST_S + STEADY_S + 0.1)  # at once again
    assert r.due("other", broken=True, now=FIRST_S + STEADY_S + 0.1)  # its own count
    assert r.tries("m") == 1 and r.tries("other") == 1
