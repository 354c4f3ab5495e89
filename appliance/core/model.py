"""One loaded model version: its config, validation, scheduler and statistics.

A ModelVersion validates a request against its config (names, datatypes,
shapes, batch size) before it is queued, so a bad request never reaches the
engine or delays a batch, then hands it to its scheduler (see
:mod:`appliance.core.scheduler`) and counts the outcome. With the response cache
(:mod:`appliance.core.response_cache`) a request seen before is answered from it,
without the scheduler. How a version is built
(backend, instances within the memory budget, completed config) is
:mod:`appliance.core.loader`'s business.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any

from appliance.config.model_config import ModelConfig
from appliance.core import memory, reshape, scheduler
from appliance.core.instances import InstanceGroup
from appliance.core.limits import RequestRules
from appliance.core.rate_limiter import RateLimiter
from appliance.core.response_cache import ResponseCache
from appliance.core.servable import State, tensor_metadata
from appliance.core.stats import ModelStats
from appliance.decoupled import with_context
from appliance.errors import ApplianceError, FailureReason
from appliance.request import InferenceRequest, InferenceResponse

__all__ = ["ModelVersion", "RequestRules", "State"]

# inputs above this many bytes are hashed for the response cache on a worker thread
_HASH_ON_LOOP_BYTES = 1 << 20


log = logging.getLogger("appliance.core.lifecycle")  # (a load's messages)

class ModelVersion:
    """A servable model version (see :class:`appliance.core.servable.Servable`), created
    READY by :func:`appliance.core.loader.load_model_version`; :meth:`unload` drains it.

    Memory: the copy's measured cost is ``memory``, charged to ``budget`` under
    ``owner`` until :meth:`unload` has closed the instances.
    """

    def __init__(
        self,
        config: ModelConfig,
        version: int,
        instances: InstanceGroup,
        max_queue_size: int,
        usage: memory.Usage = memory.NOTHING,
        budget: memory.MemoryBudget | None = None,
        owner: object = None,
        requested_instances: int = 0,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.config = config
        self.version = version
        self._state = State.READY
        self.memory = usage
        self.requested_instances = requested_instances or config.instance_count
        self.stats = ModelStats(config.name, str(version))
        self.stats.memory_usage = usage.json()
        self.stats.instances = len(instances.instances)
        self.stats.instances_requested = self.requested_instances
        self._budget = budget
        self._owner = owner
        self._instances = instances
        db = config.dynamic_batching
        self._timeout_s = db.default_timeout_us / 1e6 if db and db.default_timeout_us else None
        self._allow_override = db.allow_timeout_override if db else True
        self.rules = RequestRules(config)
        # reshape only when the config asks for it (most configs don't)
        self._reshapes = any(t.reshape is not None for t in (*config.inputs, *config.outputs))
        # engines that read a request's parameters and cancel flag (Python models)
        self._context = any(
            getattr(i.backend, "request_context", False) for i in instances.instances
        )
        self.scheduler = scheduler.create(
            config, f"{config.name}:{version}", instances, self.stats, max_queue_size, limiter
        )
        # the server's response cache when the config enables it (set by the lifecycle)
        self.cache: ResponseCache | None = None

    def use_cache(self, cache: ResponseCache | None) -> None:
        """Answer from the server's response cache when the config enables it."""
        if not self.config.response_cache:
            return
        if cache is None:
            log.warning(
                "model '%s': response_cache is enabled but the server has no cache "
                "(response_cache_size); its answers are not cached",
                self.config.name,
            )
        self.cache = cache

    @property
    def state(self) -> State:
        """READY turns UNAVAILABLE while an instance has given up (a worker process in
        a crash loop, see appliance/backends/process_host.py) until the model is loaded again."""
        if self._state is State.READY and not self._instances.healthy:
            return State.UNAVAILABLE
        return self._state

    @state.setter
    def state(self, value: State) -> None:
        self._state = value

    @property
    def ready(self) -> bool:
        return self.state == State.READY

    # ---- requests ---------------------------------------------------------------------

    async def infer(self, request: InferenceRequest, declared: bool = False) -> InferenceResponse:
        """Validate, queue, and wait for the result; records success/failure stats.
        ``declared``: a codec declared every input to this version's rules before
        decoding it (its :class:`~appliance.core.admission.Ticket` says so)."""
        start = time.perf_counter_ns()
        key = b""
        try:
            outputs, rows, signature = self.rules.check(request, declared)
            if self.cache is not None:
                key = await self._key(request, outputs)
                hit = self.cache.get(key)
                if hit is not None:
                    return self._hit(request, hit, start)
            timeout = self._timeout_s
            if request.timeout_us and self._allow_override:
                timeout = request.timeout_us / 1e6
            if self._reshapes:  # the engine sees the config's reshape
                inputs = reshape.inputs_for_model(self.config, request.inputs)
                if inputs is not request.inputs:
                    request = replace(request, inputs=inputs)
            if self._context:  # its parameters and cancel flag travel with the inputs
                request = replace(request, inputs=with_context(request.inputs, request.parameters))
                if request.parameters:  # only requests with equal parameters share a batch
                    signature = (signature, tuple(sorted(request.parameters.items())))
            result = await self.scheduler.enqueue(request, outputs, rows, signature, timeout)
        except ApplianceError as exc:  # servable.failures_counted, inline on the hot path
            self.stats.record_error(exc, time.perf_counter_ns() - start)
            raise
        except asyncio.CancelledError:  # the caller went away
            self.stats.record_failure(FailureReason.CANCELED, time.perf_counter_ns() - start)
            raise
        end = time.perf_counter_ns()
        self.stats.record_success(
            end - start, result.queue_ns, result.input_ns, result.infer_ns, result.output_ns
        )
        timing = (start, result.queue_ns, result.input_ns, result.infer_ns, result.output_ns, end)
        outputs_out = result.outputs
        if self._reshapes:
            outputs_out = reshape.outputs_for_client(self.config, outputs_out)
        if self.cache is not None:
            self.cache.put(key, outputs_out)
            self.stats.cache_miss.add(time.perf_counter_ns() - end)
        return InferenceResponse(
            self.config.name, str(self.version), outputs_out, request.id, timing
        )

    async def _key(self, request: InferenceRequest, outputs: tuple[str, ...]) -> bytes:
        """The request's cache key, hashed off the event loop when its inputs are big."""
        args = (self.config.name, str(self.version), request.inputs, outputs, request.parameters)
        if sum(a.nbytes for a in request.inputs.values()) > _HASH_ON_LOOP_BYTES:
            return await asyncio.to_thread(ResponseCache.key, *args)
        return ResponseCache.key(*args)

    def _hit(
        self, request: InferenceRequest, outputs: dict[str, Any], start: int
    ) -> InferenceResponse:
        """An answer from the cache: a success of the model that never ran it."""
        end = time.perf_counter_ns()
        self.stats.cache_hit.add(end - start)
        self.stats.success.add(end - start)
        self.stats.last_inference_ms = time.time_ns() // 1_000_000
        timing = (start, 0, 0, 0, 0, end)
        return InferenceResponse(self.config.name, str(self.version), outputs, request.id, timing)

    def metadata(self, versions: list[str]) -> dict[str, Any]:
        """KServe v2 model metadata."""
        return tensor_metadata(self.config, versions)

    def release_memory(self) -> Awaitable[Any]:
        """After a burst: each instance's engine hands back the working memory it does
        not use now (ONNX Runtime's arena), between batches."""
        return self.scheduler.release_memory()

    async def unload(self, timeout_s: float) -> None:
        """Drain queued and running requests (up to ``timeout_s``), free the instances,
        hand the freed heap back to the OS and the charge back to the budget."""
        self.state = State.UNLOADING
        budget = self._budget or memory.MemoryBudget(None)
        try:
            await self.scheduler.stop(timeout_s)
            # not while another copy is being measured: memory freed meanwhile would
            # make that copy look cheaper than it is
            async with budget.measuring():
                await self._instances.close()
                await asyncio.to_thread(memory.trim)
        finally:
            self.state = State.UNAVAILABLE
            budget.release(self._owner)
