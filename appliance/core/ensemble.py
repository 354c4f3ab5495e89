"""Ensembles: Triton's ``ensemble_scheduling`` run in-process as a DAG of steps.

Each step is a request to another loaded model, routed at call time (so a hot
swap of a step model takes effect for the next ensemble request) and queued in
that model's own batcher: frames from many callers are batched at each step by
that step's policy. Tensors travel between steps as the numpy arrays themselves,
never serialized. A step starts as soon as every tensor it reads exists, so
independent steps run concurrently.

Validation happens at load, against the step models' configs as loaded then:
unknown models, tensors no step or input provides, model tensors a map names
that do not exist, datatype and dims mismatches, outputs produced twice, and
cycles are config errors naming the step. The step models must load first
(:mod:`appliance.core.lifecycle` loads ensembles after every other model).

Failure: the first failing step fails the request with that step's error (its
code unchanged: a bad input to a step is still INVALID_ARG); steps still
running are left to finish in their own batchers and their results dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from appliance.config.ensemble_config import EnsembleStep
from appliance.config.fields import ConfigError
from appliance.config.model_config import ModelConfig, TensorConfig
from appliance.config.server_config import ServerConfig
from appliance.core import memory
from appliance.core.limits import RequestRules
from appliance.core.servable import Servable, State, failures_counted, tensor_metadata
from appliance.core.stats import ModelStats
from appliance.errors import ApplianceError, FailureReason, unavailable
from appliance.request import InferenceRequest, InferenceResponse

# (model name, version or "") -> the version serving it; raises NOT_FOUND/UNAVAILABLE
Resolver = Callable[[str, str], Servable]


def _version(step: EnsembleStep) -> str:
    return "" if step.model_version < 0 else str(step.model_version)


def _dims_agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == -1 or y == -1 or x == y for x, y in zip(a, b, strict=True))


def validate(config: ModelConfig, resolve: Resolver) -> None:
    """Raise ConfigError unless the steps form a well-typed DAG over loaded models."""
    src = config.source
    known: dict[str, TensorConfig] = {t.name: t for t in config.inputs}
    producer: dict[str, int] = {}
    for i, step in enumerate(config.ensemble_steps):
        where = f"ensemble_scheduling.step[{i}]"
        try:
            step_config = resolve(step.model_name, _version(step)).config
        except ApplianceError as exc:
            raise ConfigError(src, where + ".model_name", str(exc)) from None
        if step_config.decoupled:
            raise ConfigError(
                src,
                where,
                f"model '{step.model_name}' is decoupled (0..N responses a request); "
                "an ensemble step must answer each request once",
            )
        if config.batch_size > 0 and step_config.batch_size == 0:
            raise ConfigError(
                src,
                where,
                f"model '{step.model_name}' does not batch (max_batch_size 0) but the "
                "ensemble does; the batch dimension could not pass through it",
            )
        ins = {t.name: t for t in step_config.inputs}
        outs = {t.name: t for t in step_config.outputs}
        for kind, mapping, tensors in (
            ("input", step.input_map, ins),
            ("output", step.output_map, outs),
        ):
            for model_tensor in mapping:
                if model_tensor not in tensors:
                    raise ConfigError(
                        src,
                        f"{where}.{kind}_map",
                        f"model '{step.model_name}' has no {kind} '{model_tensor}'; "
                        f"its {kind}s are {sorted(tensors)}",
                    )
        needed = [t for t in ins.values() if not t.optional and t.name not in step.input_map]
        if needed:
            raise ConfigError(
                src,
                f"{where}.input_map",
                f"model '{step.model_name}' also needs input(s) {[t.name for t in needed]}",
            )
        for model_out, tensor in step.output_map.items():
            if tensor in known:
                raise ConfigError(
                    src,
                    f"{where}.output_map",
                    f"tensor '{tensor}' is already an ensemble input or another step's output",
                )
            producer[tensor] = i
            spec = outs[model_out]
            known[tensor] = TensorConfig(tensor, spec.datatype, spec.dims)
    # every read tensor exists somewhere, with the type the reader expects
    for i, step in enumerate(config.ensemble_steps):
        step_config = resolve(step.model_name, _version(step)).config
        ins = {t.name: t for t in step_config.inputs}
        for model_in, tensor in step.input_map.items():
            have = known.get(tensor)
            where = f"ensemble_scheduling.step[{i}].input_map.{model_in}"
            if have is None:
                raise ConfigError(
                    src, where, f"tensor '{tensor}' is neither an ensemble input nor a step output"
                )
            want = ins[model_in]
            if have.datatype != want.datatype or not _dims_agree(have.dims, want.dims):
                raise ConfigError(
                    src,
                    where,
                    f"tensor '{tensor}' is {have.datatype} {list(have.dims)} but model "
                    f"'{step.model_name}' input '{model_in}' expects {want.datatype} "
                    f"{list(want.dims)}",
                )
    for out in config.outputs:
        have = known.get(out.name)
        if have is None or out.name not in producer:
            raise ConfigError(src, f"output '{out.name}'", "no step produces this tensor")
        if have.datatype != out.datatype or not _dims_agree(have.dims, out.dims):
            raise ConfigError(
                src,
                f"output '{out.name}'",
                f"config says {out.datatype} {list(out.dims)} but the step produces "
                f"{have.datatype} {list(have.dims)}",
            )
    order(config)


def order(config: ModelConfig) -> list[list[int]]:
    """The steps in waves: every step of a wave reads only tensors of earlier waves.
    Raises ConfigError naming the steps of a cycle."""
    available = {t.name for t in config.inputs}
    left = list(range(len(config.ensemble_steps)))
    waves: list[list[int]] = []
    while left:
        wave = [i for i in left if set(config.ensemble_steps[i].input_map.values()) <= available]
        if not wave:
            names = [config.ensemble_steps[i].model_name for i in left]
            raise ConfigError(
                config.source,
                "ensemble_scheduling",
                f"steps {names} wait on each other's outputs (a cycle)",
            )
        for i in wave:
            available |= set(config.ensemble_steps[i].output_map.values())
        left = [i for i in left if i not in wave]
        waves.append(wave)
    return waves


class EnsembleVersion:
    """A servable ensemble (see :class:`appliance.core.servable.Servable`): no instances
    and no queue of its own; each step queues in its own model's scheduler.

    Statistics count whole ensemble requests, each step's model counts its own.
    Unloading waits for the requests in flight (up to the timeout); the step
    models they use keep serving them.
    """

    def __init__(self, config: ModelConfig, version: int, server: ServerConfig, resolve: Resolver):
        self.config = config
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
        validate(config, resolve)
        return cls(config, int(version_dir.name), server, resolve)

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
        running: dict[asyncio.Task[InferenceResponse], int] = {}
        try:
            while left or running:
                ready = [
                    i for i in sorted(left) if set(steps[i].input_map.values()) <= set(tensors)
                ]
                for i in ready:
                    left.discard(i)
                    step = steps[i]
                    model = self._resolve(step.model_name, _version(step))
                    request = InferenceRequest(
                        step.model_name,
                        {m: tensors[t] for m, t in step.input_map.items()},
                        outputs=tuple(step.output_map),
                        # a stateful step sees the ensemble request's sequence (Triton's)
                        sequence_id=outer.sequence_id,
                        sequence_start=outer.sequence_start,
                        sequence_end=outer.sequence_end,
                    )
                    running[asyncio.ensure_future(model.infer(request))] = i
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = running.pop(task)
                    response = task.result()  # the step's error fails the request
                    for model_out, tensor in steps[i].output_map.items():
                        tensors[tensor] = response.outputs[model_out]
        finally:
            # a step failed (or the caller went away): the others' results are not
            # needed; cancelling takes them out of their batchers' queues, and waiting
            # keeps a reference until they are done
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        return tensors
