"""appliance.backends.shared: engines built once per key, shared by reference count, closed with
the last lease; and backends.parameters, the typed parameter reads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from appliance.backends.parameters import Parameters
from appliance.backends.shared import Lease, SharedCache, file_identity
from appliance.errors import ApplianceError

LIMIT_S = 10.0


def test_concurrent_instances_build_once_and_the_last_release_closes() -> None:
    closed: list[str] = []
    builds: list[int] = []
    cache: SharedCache[str] = SharedCache(close=closed.append)
    started, go = threading.Event(), threading.Event()

    def build() -> str:
        builds.append(1)
        started.set()
        assert go.wait(LIMIT_S)  # the others arrive while this one builds
        return "engine"

    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(cache.acquire, "k", build)
        assert started.wait(LIMIT_S)
        others = [pool.submit(cache.acquire, "k", build) for _ in range(3)]
        go.set()
        leases: list[Lease[str]] = [first.result(LIMIT_S)] + [f.result(LIMIT_S) for f in others]
    assert builds == [1]
    assert [lease.value for lease in leases] == ["engine"] * 4
    assert [lease.first for lease in leases] == [True, False, False, False]
    for lease in leases[:3]:
        lease.release()
        lease.release()  # idempotent: a second release does not steal another's reference
    assert closed == [] and len(cache) == 1
    leases[3].release()
    assert closed == ["engine"] and len(cache) == 0


def test_a_failed_build_fails_every_waiter_and_is_forgotten() -> None:
    cache: SharedCache[str] = SharedCache(close=lambda v: None)
    started, go = threading.Event(), threading.Event()
    calls: list[int] = []

    def broken() -> str:
        calls.append(1)
        started.set()
        assert go.wait(LIMIT_S)
        raise RuntimeError("cannot compile")

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(cache.acquire, "k", broken)
        assert started.wait(LIMIT_S)
        second = pool.submit(cache.acquire, "k", broken)
        go.set()
        for f in (first, second):
            with pytest.raises(RuntimeError, match="cannot compile"):
                f.result(LIMIT_S)
    assert calls == [1] and len(cache) == 0
    lease = cache.acquire("k", lambda: "fixed")  # a later load tries again
    assert lease.value == "fixed" and lease.first
    lease.release()


def test_other_keys_are_not_held_up_by_a_slow_build() -> None:
    cache: SharedCache[str] = SharedCache(close=lambda v: None)
    started, go = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        assert go.wait(LIMIT_S)
        return "slow"

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(cache.acquire, "a", slow)
        assert started.wait(LIMIT_S)
        quick = cache.acquire("b", lambda: "quick")  # while "a" is still building
        assert quick.value == "quick"
        go.set()
        pending.result(LIMIT_S).release()
    quick.release()


def test_file_identity_changes_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"one")
    before = file_identity(path, tmp_path / "missing.bin")
    assert len(before) == 1 and before[0][0] == str(path.resolve())
    path.write_bytes(b"other")
    assert file_identity(path) != before


def test_parameters_read_aliases_and_name_the_bad_one() -> None:
    p = Parameters("det", {"PERFORMANCE_HINT": " latency ", "n": "3", "on": "Yes"})
    assert p.choice(("performance_hint", "PERFORMANCE_HINT"), ("LATENCY", "THROUGHPUT"), "X") == (
        "LATENCY"
    )
    assert p.choice(("absent",), ("A",), "A") == "A"
    assert p.integer(("n",), 0) == 3 and p.integer(("absent",), 7) == 7
    assert p.flag(("on",), False) is True
    with pytest.raises(ApplianceError) as bad:
        p.integer(("n",), 0, minimum=4)
    assert bad.value.message == "model 'det': parameters.n: expected an integer >= 4, got '3'"
    with pytest.raises(ApplianceError, match=r"parameters\.n: expected true or false"):
        p.flag(("n",), False)
