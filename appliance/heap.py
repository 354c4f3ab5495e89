"""The garbage collector's share of the latency tail: long-lived objects are frozen.

CPython's cyclic collector runs a full collection now and then (when the objects that
survived the younger generations have grown by a quarter), and a full collection
walks every tracked object in the process while holding the GIL: for a server that
means every module, config, model wrapper and engine binding it loaded, tens of
milliseconds on a small CPU, during which no request moves. Under load that pause
was the p99: with the collector off, the p99 of a saturated MLP under wrk fell from
38-86 ms to 15-29 ms (benchmarks/results/2026-12-02-tail-gc.md).

:func:`settle` collects once and then freezes what survived (``gc.freeze``: the
objects move to a permanent generation the collector no longer walks), so later full
collections only traverse what was allocated since: a request's short-lived objects.
The server settles when its start-up loads are done and again after every load,
unload and drain, since a model version that goes away must be collectable:
:func:`settle` unfreezes first, so the full collection it runs sees everything that
was frozen before, frees what became garbage (the cycles of an unloaded version) and
freezes the rest again. Nothing is ever kept alive by freezing; a version's memory is
returned at the first settle after it is gone.

When the server stops, :func:`release` hands everything back to the collector (an
in-process server that is stopped and dropped must not stay frozen).

A settle costs one full collection (it pauses the loop as the collector would have
at some point anyway) and runs only when the set of models changes, never per
request.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("appliance")


def settle() -> int:
    """Collect everything (frozen objects included), then freeze the survivors.
    Returns how many objects are frozen."""
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug(
        "heap settled: %d objects frozen in %.1f ms", frozen, (time.perf_counter() - started) * 1e3
    )
    return frozen


def release() -> None:
    """Give every frozen object back to the collector (the server stopped)."""
    gc.unfreeze()
