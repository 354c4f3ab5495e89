"""Schedulers: how a model version's validated requests reach its instances.

A :class:`Scheduler` owns a version's queue and decides which requests run
together on which instance. The config picks one (:func:`create`):
``sequence_batching`` gets the sequence batcher (stateful models, see
:mod:`appliance.core.sequence.batcher`), anything else the dynamic batcher (which,
without ``dynamic_batching``, runs one request per call). The model version only
validates, hands over and counts.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Hashable
from typing import Any, Protocol

from appliance.config.model_config import ModelConfig
from appliance.core.batch_queue import Levels
from appliance.core.batcher import DynamicBatcher
from appliance.core.batching import BatchPolicy, BatchResult
from appliance.core.instances import InstanceGroup
from appliance.core.rate_limiter import RateLimiter
from appliance.core.sequence.batcher import SequenceBatcher
from appliance.core.stats import ModelStats
from appliance.request import InferenceRequest

log = logging.getLogger(__name__)


class Scheduler(Protocol):
    """Contract: ``enqueue`` accepts or rejects at once (UNAVAILABLE when full or
    stopping) and resolves with the request's share of one execution; ``stop``
    stops accepting, drains within the timeout and fails the rest UNAVAILABLE."""

    @property
    def pending(self) -> int: ...

    def enqueue(
        self,
        request: InferenceRequest,
        outputs: tuple[str, ...],
        rows: int,
        signature: Hashable,
        timeout_s: float | None,
    ) -> Awaitable[BatchResult]: ...

    async def stop(self, timeout_s: float) -> None: ...

    def release_memory(self) -> Awaitable[Any]:
        """Each instance hands back the working memory its engine keeps, between
        batches; done when all have."""
        ...


def create(
    config: ModelConfig,
    label: str,
    instances: InstanceGroup,
    stats: ModelStats,
    default_max_queue_size: int,
    limiter: RateLimiter | None = None,
) -> Scheduler:
    """The scheduler ``config`` asks for, serving ``instances`` (with the server's
    rate ``limiter`` where it is on: the dynamic batcher's instances take turns)."""
    if config.sequence_batching is not None:
        if limiter is not None and any(g.rate_limiter for g in config.instance_group):
            log.warning(
                "model '%s': the sequence batcher's instances do not take turns with the "
                "rate limiter: its instance groups' rate_limiter is ignored",
                label,
            )
        return SequenceBatcher(label, config, instances, stats, default_max_queue_size)
    db = config.dynamic_batching
    policy = BatchPolicy(
        max_batch_size=config.batch_size,
        preferred_batch_sizes=db.preferred_batch_size if db else (),
        max_queue_delay_s=(db.max_queue_delay_us / 1e6) if db else 0.0,
        # a decoupled request runs alone: its response stream rides on its inputs
        dynamic=db is not None and config.batch_size > 0 and not config.decoupled,
        priority_levels=db.priority_levels if db else 0,
        default_priority_level=db.default_priority_level if db else 0,
    )
    levels = Levels(db, default_max_queue_size)  # each priority level's queue policy
    # each instance's group's rate_limiter, in the order the groups made them
    limits = [g.rate_limiter for g in config.instance_group for _ in range(g.count)]
    return DynamicBatcher(
        label,
        instances,
        policy,
        default_max_queue_size,
        stats,
        levels,
        limiter=limiter,
        limits=limits,
    )
