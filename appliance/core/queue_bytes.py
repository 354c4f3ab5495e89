"""Bytes held by requests in the server: counted per model and in total, bounded, given back.

Every inference goes through :meth:`DataPlane.infer`, which takes a :class:`Hold` on
its decoded input tensors for as long as the request is queued or executing. A hold
that would take a model's or the server's total past its limit is refused with
UNAVAILABLE (HTTP 503), so under overload the server sheds requests instead of
buffering them until the device runs out of memory. The HTTP adapter takes the hold
*before* it reads a request body, sized by the declared ``Content-Length``, so a
refused request's payload is never read into memory; once decoded, the hold is set to
the exact size of the tensors.

Rules:

- A request is admitted when its bytes fit under both limits, or when nothing at
  all is held at that level (a lone request larger than a limit is still served:
  the limit bounds memory to ``max(limit, one request)``, it never starves a model).
- Limits: ``max_queued_bytes`` in the server config (default: a quarter of
  ``memory_limit``, or an eighth of physical memory when the budget is unlimited)
  for the whole server; ``max_queued_bytes_per_model`` (default: the server's) for
  each model, which a model config may lower or raise with the parameter
  ``max_queued_bytes``.
- When the total falls back to zero after a burst in which requests of at least
  :data:`TRIM_AFTER_BYTES` came and went (admitted or refused: a refused body still
  passes through the connection's buffers), and stays zero for :data:`IDLE_S`, the
  engines first hand back the working memory they keep from the burst's big batches
  (ONNX Runtime's CPU arena, on each instance's thread between batches), then the
  freed heap is handed back to the OS (``malloc_trim`` on a worker thread): glibc
  keeps freed request buffers in its arenas otherwise, and the RSS stays near the
  burst's peak.

Concurrency: everything here runs on the event loop thread; no locks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import Any

import numpy as np

from appliance.config.fields import physical_memory
from appliance.core import memory
from appliance.core.stats import ModelStats
from appliance.errors import FailureReason, unavailable

log = logging.getLogger(__name__)

# whether other requests than the one being served hold bytes now (set by the data plane
# for the request's task): a batcher runs a cheap lone request on the event loop only
# when nothing else is in flight, so concurrent requests still batch on the threads
CONTENDED: ContextVar[bool] = ContextVar("appliance_contended", default=False)

TRIM_AFTER_BYTES = 16 * memory.MiB  # a burst smaller than this leaves little to give back
IDLE_S = 1.0  # quiet time before trimming: not between two requests of a steady stream


def tensor_bytes(inputs: Mapping[str, np.ndarray]) -> int:
    """What the decoded input tensors hold: their buffers, plus for BYTES (object)
    tensors each element's payload (the object array holds only pointers)."""
    total = 0
    for arr in inputs.values():
        total += arr.nbytes
        if arr.dtype == np.object_:
            # len() of each element in C via map; BYTES tensors are small in count
            total += sum(map(len, arr.ravel()))
    return total


def default_limit(memory_limit: int | None) -> int:
    """The server-wide default: a quarter of the models' memory budget, or an eighth
    of physical memory when the budget is unlimited (256 MiB on a 2 GiB device)."""
    if memory_limit is not None:
        return max(memory_limit // 4, memory.MiB)
    return max(physical_memory() // 8, 16 * memory.MiB)


class QueuedBytes:
    """The server-wide counter and the per-model default limit; makes :class:`Hold`s."""

    def __init__(
        self,
        limit: int,
        per_model_limit: int | None = None,
        engines: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.limit = limit
        self._engines = engines  # the engines' working memory, handed back first
        self.per_model_limit = per_model_limit or limit
        self.held = 0
        self.holding = 0  # requests holding bytes now
        self._seen = 0  # bytes of requests that came (admitted or not) since the last trim
        self._taken = 0  # holds made so far: tells an idle spell from a busy one
        self._trim_timer: asyncio.TimerHandle | None = None
        self._trimming: asyncio.Future[None] | None = None  # a reference until done

    def hold(self, stats: ModelStats | None, model_limit: int | None = None) -> Hold:
        """An empty hold on ``stats``'s model (limit: ``model_limit`` or the default);
        ``stats`` None: on the server's total only, until :meth:`Hold.assign` names the
        model (a wire that learns the model only from the payload it holds: gRPC)."""
        self._taken += 1
        return Hold(self, stats, model_limit or self.per_model_limit)

    def _changed(self, delta: int) -> None:
        self.held += delta
        self._maybe_trim()

    def _maybe_trim(self) -> None:
        if self.held == 0 and self._seen >= TRIM_AFTER_BYTES and self._trim_timer is None:
            loop = asyncio.get_running_loop()
            self._trim_timer = loop.call_later(IDLE_S, self._trim_if_idle, self._taken)

    def _trim_if_idle(self, taken: int) -> None:
        self._trim_timer = None
        if self.held or self._taken != taken:  # busy again: look after the next quiet spell
            if self.held == 0:
                loop = asyncio.get_running_loop()
                self._trim_timer = loop.call_later(IDLE_S, self._trim_if_idle, self._taken)
            return
        if self._trimming is not None and not self._trimming.done():
            return
        log.debug("trimming the heap after a burst of %s of requests", memory.fmt(self._seen))
        self._seen = 0
        self._trimming = asyncio.ensure_future(self._give_back())

    async def _give_back(self) -> None:
        if self._engines is not None:
            await self._engines()
        await asyncio.to_thread(memory.trim)


class Hold:
    """The bytes one request holds at its model and in the server's total.

    Owned by whoever made it (the adapter or the data plane), which calls
    :meth:`release` exactly once when the request is answered; further calls do
    nothing, so a ``finally`` is always safe.
    """

    __slots__ = ("_limit", "_server", "_stats", "nbytes")

    def __init__(self, server: QueuedBytes, stats: ModelStats | None, limit: int) -> None:
        self._server = server
        self._stats = stats
        self._limit = limit
        self.nbytes = 0

    def set(self, nbytes: int) -> None:
        """Hold ``nbytes`` from now on. Growing past the model's or the server's
        limit raises UNAVAILABLE (reason REJECTED) and leaves the hold unchanged;
        shrinking always succeeds."""
        delta = nbytes - self.nbytes
        if not delta:
            return
        stats = self._stats
        if delta > 0:
            self._server._seen += delta
            server = self._server.held
            if stats is not None:
                self._check_model(stats, stats.pending_bytes - self.nbytes, nbytes)
            if server - self.nbytes > 0 and server + delta > self._server.limit:
                self._server._maybe_trim()
                raise unavailable(
                    f"the server is overloaded: queued requests hold {server} bytes, a "
                    f"request of {nbytes} more would pass its limit of {self._server.limit} "
                    f"(max_queued_bytes)",
                    FailureReason.REJECTED,
                )
        if not self.nbytes and nbytes:
            self._server.holding += 1
        elif self.nbytes and not nbytes:
            self._server.holding -= 1
        self.nbytes = nbytes
        if stats is not None:
            stats.pending_bytes += delta
        self._server._changed(delta)

    def assign(self, stats: ModelStats, limit: int | None = None) -> None:
        """Count a hold taken on the server's total only (``stats`` None) at the model
        it turned out to be for, from now on: UNAVAILABLE (the hold unchanged) when
        it does not fit the model's limit. A hold already on a model stays there."""
        if self._stats is not None:
            return
        limit = limit or self._server.per_model_limit
        self._check_model(stats, stats.pending_bytes, self.nbytes, limit)
        self._stats, self._limit = stats, limit
        stats.pending_bytes += self.nbytes

    def _check_model(
        self, stats: ModelStats, others: int, nbytes: int, limit: int | None = None
    ) -> None:
        """UNAVAILABLE when ``nbytes`` beside ``others`` (the model's other holds) pass
        the model's limit; a lone request is always admitted."""
        limit = limit or self._limit
        if others > 0 and others + nbytes > limit:
            self._server._maybe_trim()
            raise unavailable(
                f"model '{stats.name}' is overloaded: its queued requests hold "
                f"{others} bytes, a request of {nbytes} more would pass its limit of "
                f"{limit} (max_queued_bytes)",
                FailureReason.REJECTED,
            )

    def release(self) -> None:
        if self.nbytes:
            self.set(0)
