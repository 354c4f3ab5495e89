"""Long-lived objects are frozen out of the collector's full walks (appliance/heap.py),
and what a model that goes away leaves behind is still freed."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance import heap
from appliance.config.server_config import load_server_config
from appliance.core.lifecycle import ModelLifeCycle
from devtools import modelgen


class _Cycle:
    """An object only the cyclic collector can free."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # leave the test session's collector as it was


def test_a_settle_freezes_survivors_and_the_next_frees_what_was_dropped() -> None:
    node = _Cycle()
    ref = weakref.ref(node)
    assert heap.settle() > 0
    del node
    gc.collect()
    assert ref() is not None  # frozen: an ordinary full collection does not walk it
    heap.settle()
    assert ref() is None  # the next settle unfreezes first, so the cycle is freed
    heap.release()
    assert gc.get_freeze_count() == 0


def test_the_lifecycle_freezes_after_start_and_frees_an_unloaded_model(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    modelgen.write_demo_repository(repo)
    server = load_server_config(
        None,
        {"model_repository": repo, "model_control_mode": "explicit", "load_model": ["simple"]},
    )

    async def run() -> tuple[int, int, bool, int]:
        gc.unfreeze()
        lifecycle = ModelLifeCycle(repo, server)
        await lifecycle.start()
        frozen_at_start = gc.get_freeze_count()
        # a cycle that hangs off the serving copy: it was frozen with the copy
        anchor = _Cycle()
        anchor.copy = lifecycle.get("simple")  # type: ignore[attr-defined]
        ref = weakref.ref(anchor)
        heap.settle()
        del anchor
        frozen_while_serving = gc.get_freeze_count()
        await lifecycle.unload("simple")  # its drain settles once the copy is gone
        freed = ref() is None
        await lifecycle.stop(5)
        return frozen_at_start, frozen_while_serving, freed, gc.get_freeze_count()

    frozen_at_start, frozen_while_serving, freed, frozen_after_stop = asyncio.run(run())
    assert frozen_at_start > 0 and frozen_while_serving > 0
    assert freed, "an object frozen with an unloaded model was not freed by its drain"
    assert frozen_after_stop == 0  # a stopped server leaves nothing frozen
