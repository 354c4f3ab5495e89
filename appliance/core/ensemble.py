"""Ensembles: Triton's ``ensemble_scheduling`` run in-process as a DAG of steps.

Each step is a request to another loaded model, routed at call time (so a hot
swap of a step model takes effect for the next ensemble request) and queued in
that model's own batcher: frames from many callers are batched at each step by
that step's policy. Tensors travel between steps as the numpy arrays themselves,
never serialized. A step starts as soon as every tensor it reads exists, so
independent steps run concurrently.

The steps are checked at load into a plan (:mod:`appliance.core.ensemble_plan`),
which also says which steps fan out: their inputs' rows go to the step model in
chunks of at most its ``max_batch_size`` rows, each a request of its own (row views,
no copies), and the chunks' outputs are joined back in row order.

Failure: the first failing step (or chunk) fails the request with that step's error
(its code unchanged: a bad input to a step is still INVALID_ARG); steps still
running are cancelled out of their batchers' queues and their results dropped.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from appliance import datatypes
from appliance.config.ensemble_config import EnsembleStep
from appliance.config.model_config import ModelConfig
from appliance.config.server_config import ServerConfig
from appliance.core import memory
from appliance.core.ensemble_plan import Plan, Resolver, plan, step_version
from appliance.core.limits import RequestRules
from appliance.core.servable import State, failures_counted, tensor_metadata
from appliance.core.stats import ModelStats
from appliance.errors import FailureReason, invalid, unavailable
from appliance.request import InferenceRequest, InferenceResponse

__all__ = ["EnsembleVersion", "Resolver"]


class EnsembleVersion:
    """A servable ensemble (see :class:`appliance.core.servable.Servable`): no instances
    and no queue of its own; each step queues in its own model's scheduler.

    Statistics count whole ensemble requests, each step's model counts its own.
    Unloading waits for the requests in flight (up to the timeout); the step
    models they use keep serving them.
    """

    def __init__(
        self,
        config: ModelConfig,
        version: int,
        server: ServerConfig,
        resolve: Resolver,
        steps_plan: Plan | None = None,
    ):
        self.config = config
        self._plan = steps_plan or plan(config, resolve)
        self.rules = RequestRules(config)
        self.version = version
        self.state = State.READY
        self.memory = memory.NOTHING
        self.stats = ModelStats(config.name, str(version))
        self._resolve = resolve
        self._in_flight: set[asyncio.Task[dict[str, np.ndarray]]] = set()

    @classmethod
    def load_ensemble(
        cls, config: ModelConfig, version_dir: Path, server: ServerConfig, resolve: Resolver
    ) -> EnsembleVersion:
        return cls(config, int(version_dir.name), server, resolve, plan(config, resolve))

    @property
    def ready(self) -> bool:
        return self.state == State.READY

    def metadata(self, versions: list[str]) -> dict[str, Any]:
        return tensor_metadata(self.config, versions)

    async def infer(self, request: InferenceRequest, declared: bool = False) -> InferenceResponse:
        start = time.perf_counter_ns()
        with failures_counted(self.stats, start):
            if self.state != State.READY:
                raise unavailable(
                    f"model '{self.config.name}' is unloading", FailureReason.REJECTED
                )
            outputs, _, _ = self.rules.check(request, declared)
            task = asyncio.ensure_future(self._run(dict(request.inputs), request))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
            tensors = await task
        total = time.perf_counter_ns() - start
        self.stats.record_success(total, 0, 0, total, 0)
        rows = max((int(a.shape[0]) for a in request.inputs.values() if a.ndim), default=1)
        self.stats.record_execution(rows if self.config.batch_size > 0 else 1, 0, total, 0)
        return InferenceResponse(
            self.config.name, str(self.version), {n: tensors[n] for n in outputs}, request.id
        )

    async def unload(self, timeout_s: float) -> None:
        """Stop taking requests and let those in flight finish (up to ``timeout_s``)."""
        self.state = State.UNLOADING
        try:
            if self._in_flight:
                await asyncio.wait(set(self._in_flight), timeout=timeout_s)
        finally:
            self.state = State.UNAVAILABLE

    async def _run(
        self, tensors: dict[str, np.ndarray], outer: InferenceRequest
    ) -> dict[str, np.ndarray]:
        steps = self.config.ensemble_steps
        left = set(range(len(steps)))
        running: dict[asyncio.Future[dict[str, np.ndarray]], int] = {}
        try:
            while left or running:
                ready = [
                    i for i in sorted(left) if set(steps[i].input_map.values()) <= set(tensors)
                ]
                for i in ready:
                    left.discard(i)
                    inputs = {m: tensors[t] for m, t in steps[i].input_map.items()}
                    if i in self._plan.fan_out:
                        call = self._fan_out(i, inputs, outer)
                    else:
                        call = self._step(i, inputs, outer)
                    running[asyncio.ensure_future(call)] = i
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = running.pop(task)
                    outputs = task.result()  # the step's error fails the request
                    for model_out, tensor in steps[i].output_map.items():
                        tensors[tensor] = outputs[model_out]
        finally:
            # a step failed (or the caller went away): the others' results are not
            # needed; cancelling takes them out of their batchers' queues, and waiting
            # keeps a reference until they are done
            await _cancel(running)
        return tensors

    async def _step(
        self, i: int, inputs: dict[str, np.ndarray], outer: InferenceRequest
    ) -> dict[str, np.ndarray]:
        """One request to step ``i``'s model; its outputs by the model's names."""
        step = self.config.ensemble_steps[i]
        model = self._resolve(step.model_name, step_version(step))
        request = InferenceRequest(
            step.model_name,
            inputs,
            outputs=tuple(step.output_map),
            # a stateful step sees the ensemble request's sequence (Triton's)
            sequence_id=outer.sequence_id,
            sequence_start=outer.sequence_start,
            sequence_end=outer.sequence_end,
        )
        return (await model.infer(request)).outputs

    async def _fan_out(
        self, i: int, inputs: dict[str, np.ndarray], outer: InferenceRequest
    ) -> dict[str, np.ndarray]:
        """Step ``i`` over the rows of its inputs: chunks of at most the model's
        ``max_batch_size`` rows, each its own request, outputs joined in row order."""
        step = self.config.ensemble_steps[i]
        where = f"ensemble '{self.config.name}' step {i} (model '{step.model_name}')"
        counts = {int(a.shape[0]) if a.ndim else -1 for a in inputs.values()}
        if len(counts) != 1 or -1 in counts:
            shapes = {name: list(a.shape) for name, a in inputs.items()}
            raise invalid(f"{where}: its inputs must have the same number of rows, got {shapes}")
        (rows,) = counts
        if rows > self._plan.max_fan_out:
            raise invalid(
                f"{where}: {rows} rows to fan out, more than the {self._plan.max_fan_out} "
                "one request may (parameters.max_fan_out of the ensemble)"
            )
        model = self._resolve(step.model_name, step_version(step))
        if rows == 0:
            return _no_rows(model.config, step)
        chunk = max(1, model.config.batch_size)
        calls = [
            asyncio.ensure_future(
                self._step(i, {n: a[start : start + chunk] for n, a in inputs.items()}, outer)
            )
            for start in range(0, rows, chunk)
        ]
        try:
            parts = await asyncio.gather(*calls)
        finally:
            await _cancel(dict.fromkeys(calls, i))
        if len(parts) == 1:
            return parts[0]
        joined = {}
        for name in step.output_map:
            pieces = [p[name] for p in parts]
            if len({p.shape[1:] for p in pieces}) != 1:
                raise invalid(
                    f"{where}: output '{name}' has rows of different shapes across chunks "
                    f"({sorted({p.shape[1:] for p in pieces})}); it cannot be joined"
                )
            joined[name] = np.concatenate(pieces)
        return joined


def _no_rows(config: ModelConfig, step: EnsembleStep) -> dict[str, np.ndarray]:
    """A fan-out over no rows: each output empty, with its declared shape after the rows."""
    specs = {t.name: t for t in config.outputs}
    out = {}
    for name in step.output_map:
        spec = specs[name]
        shape = (0, *(max(d, 0) for d in spec.dims))
        out[name] = np.empty(shape, datatypes.to_numpy_dtype(spec.datatype))
    return out


async def _cancel(running: dict[Any, int]) -> None:
    """Cancel the calls still running and wait until they are done."""
    for task in running:
        task.cancel()
    if running:
        await asyncio.gather(*running, return_exceptions=True)
