"""The sequence batcher's strategies: which ready requests form an instance's next batch.

Pure functions of the ready requests and a monotonic ``now``, like
:func:`appliance.core.batching.decide`, so their rules are unit-tested without an event
loop. Each instance's sequences sit in slots; at most one request per sequence
(the oldest it has queued, its *head*) is ready at a time.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from appliance.core.batching import BatchPolicy, Queued, decide


@dataclass(frozen=True, slots=True)
class DirectPlan:
    """``rows``: the slot feeding each batch row (-1: a filler row, READY false);
    empty with ``wait_s`` when the batch should wait for more slots to be ready."""

    rows: tuple[int, ...] = ()
    wait_s: float | None = None


def plan_direct(
    heads: list[tuple[int, Hashable, float]],
    slots: int,
    now: float,
    delay_s: float,
    utilization: float,
) -> DirectPlan:
    """The direct strategy's next batch for one instance, from the ready head of
    each slot: (slot, shape signature, arrival), slots ascending.

    Batch row i is slot i, up to the highest ready slot, so a model may keep
    per-slot state of its own; slots with nothing ready, or whose request's
    shapes differ from the lowest ready slot's, get a filler row. While fewer
    than ``utilization`` x ``slots`` slots are ready, the batch waits up to
    ``delay_s`` after the oldest ready request.
    """
    if not heads:
        return DirectPlan()
    if delay_s > 0 and len(heads) < utilization * slots:
        oldest = min(arrival for _, _, arrival in heads)
        if now - oldest < delay_s:
            return DirectPlan(wait_s=oldest + delay_s - now)
    first = heads[0][1]
    rows = [-1] * (max(slot for slot, _, _ in heads) + 1)
    for slot, signature, _ in heads:
        if signature == first:
            rows[slot] = slot
    while rows[-1] == -1:
        rows.pop()
    return DirectPlan(tuple(rows))


def plan_oldest(
    heads: Sequence[Queued], now: float, policy: BatchPolicy
) -> tuple[tuple[int, ...], float | None]:
    """The oldest strategy's next batch: the ready heads (oldest first) batched by
    the dynamic batcher's rules (preferred sizes, queue delay, equal shapes), one
    request per sequence. Returns (positions in ``heads`` to run now, or () and
    how long to wait)."""
    decision = decide(heads, now, policy)
    return decision.send, decision.wait_s
