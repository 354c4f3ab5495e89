"""Ensembles: Triton's ``ensemble_scheduling`` run in-process as a DAG of steps.

Each step is a request to another loaded model, routed at call time (so a hot
swap of a step model takes effect for the next ensemble request) and queued in
that model's own batcher: frames from many callers are batched at each step by
that step's policy. Tensors travel between steps as the numpy arrays themselves,
never serialized. A step starts as soon as every tensor it reads exists, so
independent steps run concurrently.

The steps are checked at load into a plan (:mod:`appliance.core.ensemble.plan`),
which also says which steps fan out: their inputs' rows go to the step model in
chunks of at most its ``max_batch_size`` rows, each a request of its own (row views,
no copies), and the chunks' outputs are joined back in row order.

Failure: the first failing step (or chunk) fails the request with that step's error
(its code unchanged: a bad input to a step is still INVALID_ARG); steps still
running are cancelled out of their batchers' queues and their results dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from appliance import datatypes, decoupled
from appliance.config.ensemble_config import EnsembleStep
from appliance.config.model_config import ModelConfig
from appliance.config.server_config import ServerConfig
from appliance.core import memory, reshape, streaming
from appliance.core.ensemble.plan import Plan, Resolver, carried_shape, plan, step_version
from appliance.core.limits import RequestRules
from appliance.core.servable import Servable, State, failures_counted, tensor_metadata
from appliance.core.stats import ModelStats
from appliance.decoupled import ResponseStream
from appliance.errors import ApplianceError, FailureReason, invalid, unavailable
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
        self._plan = steps_plan or plan(config, resolve)
        labels = self._plan.labels
        self.config = dataclasses.replace(
            config,
            outputs=tuple(
                dataclasses.replace(t, labels=labels[t.name]) if t.name in labels else t
                for t in config.outputs
            ),
        )
        if self._plan.decoupled:  # each response of a decoupled step flows on: so does ours
            self.config = dataclasses.replace(self.config, decoupled=True)
        self.rules = RequestRules(self.config)
        self.version = version
        self.state = State.READY
        self.memory = memory.NOTHING
        self.stats = ModelStats(config.name, str(version))
        self._resolve = resolve
        self._outputs = {t.name: t for t in self.config.outputs}
        self._in_flight: set[asyncio.Task[Any]] = set()

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
            if self._plan.decoupled:  # 0..N responses, into the request's stream
                stream = decoupled.stream_of(request.inputs, self.config.name)
                streamed = asyncio.ensure_future(self._run_decoupled(request, outputs, stream))
                self._in_flight.add(streamed)
                streamed.add_done_callback(self._in_flight.discard)
                await streamed
                tensors = {}  # every response travelled through the stream
            else:
                task = asyncio.ensure_future(self._run(dict(request.inputs), request))
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)
                made, batches = await task
                # an output no step made (its step left out for an optional input that
                # was not given) is left out of the answer, as Triton's
                tensors = {n: self._carried(n, made[n], batches[n]) for n in outputs if n in made}
        total = time.perf_counter_ns() - start
        self.stats.record_success(total, 0, 0, total, 0)
        rows = max((int(a.shape[0]) for a in request.inputs.values() if a.ndim), default=1)
        self.stats.record_execution(rows if self.config.batch_size > 0 else 1, 0, total, 0)
        return InferenceResponse(self.config.name, str(self.version), tensors, request.id)

    def _carried(self, name: str, array: np.ndarray, batch: int) -> np.ndarray:
        """An ensemble output in the shape the ensemble's config gives it (the batch dim
        of 1 added or dropped as Triton does, :func:`carried_shape`)."""
        spec = self._outputs[name]
        shape = carried_shape(spec.dims, self.config.batch_size > 0, batch, array.shape)
        return array if shape == array.shape else array.reshape(shape)

    async def unload(self, timeout_s: float) -> None:
        """Stop taking requests and let those in flight finish (up to ``timeout_s``)."""
        self.state = State.UNLOADING
        try:
            if self._in_flight:
                await asyncio.wait(set(self._in_flight), timeout=timeout_s)
        finally:
            self.state = State.UNAVAILABLE

    def _start(
        self, tensors: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, int], set[str]]:
        """A request's tensors, the batch size each came with, and the tensors absent:
        optional ensemble inputs the request left out (and, later, step outputs a model
        left out): the steps reading them run without them (Triton's; their models'
        inputs must be optional, or that step refuses its request)."""
        batch = 0
        if self.config.batch_size > 0:
            batch = next((int(a.shape[0]) for a in tensors.values() if a.ndim), 0)
        absent = {t.name for t in self.config.inputs if t.optional} - set(tensors)
        return tensors, dict.fromkeys(tensors, batch), absent

    async def _run(
        self,
        tensors: dict[str, np.ndarray],
        outer: InferenceRequest,
        only: set[int] | None = None,
        made: tuple[dict[str, int], set[str]] | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Every tensor the steps made (``only``: these steps, with the batch sizes and
        absent tensors of ``made``), and the batch size of the request that made each (0:
        it did not batch), which :func:`carried_shape` needs."""
        steps = self.config.ensemble_steps
        left = set(range(len(steps))) if only is None else set(only)
        if made is None:
            tensors, batches, absent = self._start(tensors)
        else:
            batches, absent = made
        running: dict[asyncio.Future[tuple[dict[str, np.ndarray], int]], int] = {}
        try:
            while left or running:
                ready = [
                    i
                    for i in sorted(left)
                    if set(steps[i].input_map.values()) <= tensors.keys() | absent
                ]
                if not ready and not running:
                    break  # nothing left can run (a guard: every tensor is made or absent)
                for i in ready:
                    left.discard(i)
                    inputs = {m: tensors[t] for m, t in steps[i].input_map.items() if t in tensors}
                    if i in self._plan.fan_out:
                        call = self._fan_out(i, inputs, outer)
                    else:
                        sizes = {
                            m: batches[t] for m, t in steps[i].input_map.items() if t in tensors
                        }
                        call = self._step(i, inputs, outer, sizes)
                    running[asyncio.ensure_future(call)] = i
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = running.pop(task)
                    outputs, made_by = task.result()  # the step's error fails the request
                    for model_out, tensor in steps[i].output_map.items():
                        if model_out in outputs:
                            tensors[tensor] = outputs[model_out]
                            batches[tensor] = made_by
                        else:  # the model left it out: the steps reading it run without
                            absent.add(tensor)
        finally:
            # a step failed (or the caller went away): the others' results are not
            # needed; cancelling takes them out of their batchers' queues, and waiting
            # keeps a reference until they are done
            await _cancel(running)
        return tensors, batches

    async def _run_decoupled(
        self, request: InferenceRequest, outputs: tuple[str, ...], stream: ResponseStream
    ) -> None:
        """An ensemble with decoupled steps: each response of a decoupled step runs the
        steps of its context (:attr:`Plan.context`) on that response's tensors, one
        response after the other, and each time the outputs' context is complete its
        outputs are one response of the ensemble; the final flag follows the last."""

        def emit(tensors: dict[str, np.ndarray], batches: dict[str, int]) -> None:
            stream.put(
                {n: self._carried(n, tensors[n], batches[n]) for n in outputs if n in tensors},
                False,
            )

        tensors, batches, absent = self._start(dict(request.inputs))
        await self._context(None, tensors, batches, absent, request, emit, stream)
        stream.put(None, True)

    async def _context(
        self,
        context: int | None,
        tensors: dict[str, np.ndarray],
        batches: dict[str, int],
        absent: set[str],
        outer: InferenceRequest,
        emit: Callable[[dict[str, np.ndarray], dict[str, int]], None],
        stream: ResponseStream,
    ) -> None:
        """The steps of one context: its regular steps (concurrently where they can),
        the ensemble's response when this is the outputs' context, then its decoupled
        steps, concurrently, each response of each running the steps of its own."""
        plan = self._plan
        mine = {i for i, c in enumerate(plan.context) if c == context}
        tensors, batches = await self._run(tensors, outer, mine - plan.decoupled, (batches, absent))
        if context == plan.out_context:
            emit(tensors, batches)
        calls = [
            self._decoupled_step(i, tensors, batches, absent, outer, emit, stream)
            for i in sorted(mine & plan.decoupled)
            if set(self.config.ensemble_steps[i].input_map.values()) <= tensors.keys() | absent
        ]
        running = {asyncio.ensure_future(c): 0 for c in calls}
        try:
            for task in running:
                await task
        finally:
            await _cancel(running)

    async def _decoupled_step(
        self,
        i: int,
        tensors: dict[str, np.ndarray],
        batches: dict[str, int],
        absent: set[str],
        outer: InferenceRequest,
        emit: Callable[[dict[str, np.ndarray], dict[str, int]], None],
        stream: ResponseStream,
    ) -> None:
        """Decoupled step ``i`` on the context's tensors; an error it sends is one
        response of the ensemble, and the request goes on."""
        step = self.config.ensemble_steps[i]
        inputs = {m: tensors[t] for m, t in step.input_map.items() if t in tensors}
        request, model, made_by = self._request(
            i, inputs, outer, {m: batches[t] for m, t in step.input_map.items() if t in tensors}
        )
        async for item, _final in streaming.responses(model, request):
            if isinstance(item, ApplianceError):
                stream.put(item, False)
                continue
            if item is None:
                continue  # the final flag alone
            made = reshape.outputs_for_client(model.config, item)
            child, child_batches, child_absent = dict(tensors), dict(batches), set(absent)
            for model_out, tensor in step.output_map.items():
                if model_out in made:
                    child[tensor] = made[model_out]
                    child_batches[tensor] = made_by
                else:
                    child_absent.add(tensor)
            await self._context(i, child, child_batches, child_absent, outer, emit, stream)

    async def _step(
        self,
        i: int,
        inputs: dict[str, np.ndarray],
        outer: InferenceRequest,
        batches: dict[str, int] | None = None,
    ) -> tuple[dict[str, np.ndarray], int]:
        """One request to step ``i``'s model: its outputs by the model's names, and the
        request's batch size (0 where the model does not batch). ``batches``: each
        input's batch size as made (None: the inputs are the model's rows already)."""
        request, model, made_by = self._request(i, inputs, outer, batches)
        return (await model.infer(request)).outputs, made_by

    def _request(
        self,
        i: int,
        inputs: dict[str, np.ndarray],
        outer: InferenceRequest,
        batches: dict[str, int] | None,
    ) -> tuple[InferenceRequest, Servable, int]:
        """Step ``i``'s request, the model version serving it, and the request's batch
        size (0 where the model does not batch)."""
        step = self.config.ensemble_steps[i]
        model = self._resolve(step.model_name, step_version(step))
        batching = model.config.batch_size > 0
        if batches is not None:
            specs = {t.name: t for t in model.config.inputs}
            for name, array in inputs.items():
                shape = carried_shape(specs[name].dims, batching, batches[name], array.shape)
                if shape != array.shape:
                    inputs[name] = array.reshape(shape)
        made_by = next((int(a.shape[0]) for a in inputs.values() if a.ndim), 0)
        request = InferenceRequest(
            step.model_name,
            inputs,
            outputs=tuple(step.output_map),
            # a stateful step sees the ensemble request's sequence (Triton's)
            sequence_id=outer.sequence_id,
            sequence_start=outer.sequence_start,
            sequence_end=outer.sequence_end,
            # each step sees the ensemble request's own parameters (Triton's)
            parameters=outer.parameters,
        )
        return request, model, made_by if batching else 0

    async def _fan_out(
        self, i: int, inputs: dict[str, np.ndarray], outer: InferenceRequest
    ) -> tuple[dict[str, np.ndarray], int]:
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
            return _no_rows(model.config, step), 0
        chunk = max(1, model.config.batch_size)
        calls = [
            asyncio.ensure_future(
                self._step(i, {n: a[start : start + chunk] for n, a in inputs.items()}, outer)
            )
            for start in range(0, rows, chunk)
        ]
        try:
            parts = [outputs for outputs, _ in await asyncio.gather(*calls)]
        finally:
            await _cancel(dict.fromkeys(calls, i))
        if len(parts) == 1:
            return parts[0], 0
        joined = {}
        for name in step.output_map:
            pieces = [p[name] for p in parts]
            if len({p.shape[1:] for p in pieces}) != 1:
                raise invalid(
                    f"{where}: output '{name}' has rows of different shapes across chunks "
                    f"({sorted({p.shape[1:] for p in pieces})}); it cannot be joined"
                )
            joined[name] = np.concatenate(pieces)
        return joined, 0  # rows, as the plan says: no batch dim of a request


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
