"""Instance groups: N copies of a model, each driven by its own worker thread.

An instance is created, used and closed on its own single-thread executor, so a
backend never sees two threads and engines with thread-affine state (CUDA
contexts) are safe. The event loop only hands work over and awaits the result.
How many instances a copy gets is decided here too, one by one within the
memory budget (:func:`start_within_budget`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from appliance.backends.base import Backend
from appliance.core import memory

log = logging.getLogger(__name__)
T = TypeVar("T")


def cpu_share(instance_count: int) -> int:
    """Intra-op threads for one instance: an equal share of the usable cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, instance_count))


class ModelInstance:
    """One backend object plus the one thread allowed to touch it."""

    def __init__(
        self,
        name: str,
        executor: ThreadPoolExecutor,
        backend: Backend,
        created: memory.Usage = memory.NOTHING,
    ) -> None:
        self.name = name
        self.backend = backend
        self.created = created  # memory growth while the backend was built
        self._executor = executor

    @classmethod
    async def start(
        cls, model: str, index: int, factory: Callable[[int], Backend]
    ) -> ModelInstance:
        """Build instance ``index`` on a new thread of its own, measuring its memory.

        On failure the thread is shut down and the error raised.
        """
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{model}#{index}")
        loop = asyncio.get_running_loop()
        try:
            backend, usage = await loop.run_in_executor(executor, memory.measure, factory, index)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(f"{model}_{index}", executor, backend, usage)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(backend, *args)`` on this instance's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, self.backend, *args)

    def occupy(self, fn: Callable[..., None], *args: Any) -> concurrent.futures.Future[None]:
        """Hand this instance's thread to ``fn(backend, *args)`` until it returns (a
        scheduler's loop); what is run later on the thread waits for it."""
        return self._executor.submit(fn, self.backend, *args)

    async def run_measured(self, fn: Callable[..., T], *args: Any) -> tuple[T, memory.Usage]:
        """:meth:`run`, returning also the memory growth it caused."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, memory.measure, fn, self.backend, *args)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self.backend.close)
        finally:
            # wait=False: the thread has no queued work left once close ran
            self._executor.shutdown(wait=False)


class InstanceGroup:
    """The instances of one model version.

    Ownership: the model's scheduler occupies each instance's thread (the dynamic
    batcher's loops) or runs batches on it; ``close`` must only be called once the
    scheduler stopped and no batch is running.
    """

    def __init__(self, instances: list[ModelInstance]) -> None:
        self.instances = instances

    @classmethod
    async def create(
        cls, model: str, count: int, factory: Callable[[int], Backend]
    ) -> InstanceGroup:
        """Create ``count`` instances concurrently, each on its own new thread.

        On failure every instance already created is closed and the error raised.
        """

        results = await asyncio.gather(
            *(ModelInstance.start(model, i, factory) for i in range(count)),
            return_exceptions=True,
        )
        made = [r for r in results if isinstance(r, ModelInstance)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(m.close() for m in made), return_exceptions=True)
            raise errors[0]
        return cls(made)

    @property
    def healthy(self) -> bool:
        """False once an instance's backend gave up (``healthy`` False: an isolated
        model's worker process crashed too often in a row)."""
        return all(getattr(i.backend, "healthy", True) for i in self.instances)

    async def close(self) -> None:
        results = await asyncio.gather(*(i.close() for i in self.instances), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.warning("closing an instance failed: %s", r)


# Warm an instance up: (its whole measured cost, the part its warm-up added).
Warm = Callable[[ModelInstance], Awaitable[tuple[memory.Usage, memory.Usage]]]


@dataclass(frozen=True, slots=True)
class Admitted:
    """The instances a copy got and what they cost: ``held`` in all, charged to
    the budget under ``owner``; ``first`` the first instance, ``each_further``
    what one more instance costs (as measured)."""

    group: InstanceGroup
    held: memory.Usage
    owner: object
    first: memory.Usage
    each_further: memory.Usage


async def start_within_budget(
    admission: memory.Admission,
    model: str,
    factory: Callable[[int], Backend],
    requested: int,
    required: int,
    guess: Callable[[], int],
    prepare: Callable[[ModelInstance], Awaitable[Warm]],
) -> Admitted:
    """Start up to ``requested`` instances, one by one, each measured while it is
    built and warmed up, admitted while it fits ``admission``.

    ``guess()`` estimates the first instance before it is built (a known cost, or
    the model file's size); ``prepare(first)`` runs once the first instance
    exists (the loader completes the config from it) and returns how to warm
    every instance. Fewer than ``required`` instances (one, or during a hot swap
    what the old copy had) is a refusal: everything made is closed, the charge
    released, and :class:`appliance.core.memory.BudgetRefused` raised naming the
    budget, what is in use and what was needed. Warm-up failures fail the same
    way.
    """
    budget = admission.budget
    made: list[ModelInstance] = []
    try:
        async with budget.measuring():
            estimate = guess()
            if not admission.fits(estimate):
                raise memory.BudgetRefused(admission.refusal("one instance (estimated)", estimate))
            made.append(await ModelInstance.start(model, 0, factory))
            warm = await prepare(made[0])
            first_cost, working = await warm(made[0])
            if not admission.fits(first_cost.total):
                raise memory.BudgetRefused(admission.refusal("one instance", first_cost.total))
            admission.add(first_cost)
            # what one more instance needs at least: its working memory (weights may
            # be shared); once one was measured, what that one really cost
            extra = working
            while len(made) < requested and admission.fits(extra.total):
                made.append(await ModelInstance.start(model, len(made), factory))
                cost, _ = await warm(made[-1])
                cost = cost.at_least(working)
                if not admission.fits(cost.total):
                    await made.pop().close()
                    break
                admission.add(cost)
                extra = cost
        if len(made) < required:
            raise memory.BudgetRefused(
                admission.refusal(
                    f"{required} instance(s) (as many as the copy it replaces)",
                    admission.held.total + extra.total * (required - len(made)),
                )
            )
    except BaseException:
        budget.release(admission.owner)
        await InstanceGroup(made).close()
        raise
    return Admitted(InstanceGroup(made), admission.held, admission.owner, first_cost, extra)
