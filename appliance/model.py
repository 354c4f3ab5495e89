"""One loaded model version: its config, instances, batcher and statistics.

A ModelVersion validates a request against its config (names, datatypes,
shapes, batch size) before it is queued, so a bad request never reaches the
engine or delays a batch, then hands it to its batcher.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

import backends
from appliance import datatypes, memory, warmup
from appliance.batcher import BatchPolicy, DynamicBatcher
from appliance.config import ConfigError, ModelConfig, TensorConfig, complete
from appliance.config import InstanceGroup as GroupConfig
from appliance.errors import ApplianceError, FailureReason, invalid
from appliance.instances import InstanceGroup, ModelInstance, cpu_share
from appliance.request import InferenceRequest, InferenceResponse
from appliance.server_config import ServerConfig, parse_size
from appliance.stats import ModelStats
from appliance.triton_config import to_triton_json
from backends.base import BackendOptions, TensorSpec, memory_usage

log = logging.getLogger(__name__)


class State(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


def resolve_backend(config: ModelConfig, version_dir: Path) -> tuple[str, Path]:
    """Which backend serves this version and from which file."""
    name = config.backend or backends.PLATFORMS.get(config.platform, "")
    if config.platform and not name:
        raise ConfigError(
            config.source,
            "platform",
            f"unsupported platform {config.platform!r}, "
            f"expected one of {sorted(backends.PLATFORMS)}",
        )
    filename = config.default_model_filename
    if not name:  # neither named: go by the file that is there
        candidates = [p for p in sorted(version_dir.iterdir()) if backends.backend_for_file(p)]
        if filename:
            candidates = [version_dir / filename]
        if not candidates:
            raise invalid(
                f"model '{config.name}': no model file in {version_dir} "
                f"(expected one of {sorted(backends.BY_SUFFIX)})"
            )
        name = backends.backend_for_file(candidates[0]) or ""
        filename = candidates[0].name
    if name not in backends.BACKENDS:
        raise ConfigError(
            config.source,
            "backend",
            f"unknown backend {name!r}, expected one of {sorted(backends.BACKENDS)}",
        )
    path = version_dir / (filename or backends.DEFAULT_FILENAMES[name])
    if not path.exists():
        raise invalid(
            f"model '{config.name}' version {version_dir.name}: model file {path} does not exist"
        )
    return name, path


def declared_tensors(
    config: ModelConfig,
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The config's tensors as engine specs (batch dim -1 where the model batches)."""
    batch = (-1,) if config.batch_size > 0 else ()

    def specs(tensors: tuple[TensorConfig, ...]) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(t.name, t.datatype, batch + t.dims) for t in tensors)

    return specs(config.inputs), specs(config.outputs)


_LOADS = itertools.count(1)  # share groups: one per loaded copy


def _trimmed(groups: tuple[GroupConfig, ...], admitted: int) -> tuple[GroupConfig, ...]:
    """The instance groups cut down to the ``admitted`` first instances."""
    out = []
    for g in groups:
        take = min(g.count, admitted)
        if take:
            out.append(replace(g, count=take))
        admitted -= take
    return tuple(out)


class ModelVersion:
    """A servable version. Created READY by :meth:`load`; :meth:`unload` drains it.

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
    ) -> None:
        self.config = config
        self.version = version
        self.state = State.READY
        self.memory = usage
        self.requested_instances = requested_instances or config.instance_count
        self.stats = ModelStats(config.name, str(version))
        self.stats.memory_usage = usage.json()
        self.stats.instances = len(instances.instances)
        self.stats.instances_requested = self.requested_instances
        self._budget = budget
        self._owner = owner
        self._instances = instances
        self._inputs = {t.name: t for t in config.inputs}
        # this model's bound on its queued requests' input bytes (None: the server's
        # max_queued_bytes_per_model); see appliance.queue_bytes
        limit = config.parameters.get("max_queued_bytes")
        self.max_queued_bytes = (
            None
            if limit is None
            else parse_size(limit, config.source, "parameters.max_queued_bytes")
        )
        self._outputs = tuple(t.name for t in config.outputs)
        db = config.dynamic_batching
        policy = BatchPolicy(
            max_batch_size=config.batch_size,
            preferred_batch_sizes=db.preferred_batch_size if db else (),
            max_queue_delay_s=(db.max_queue_delay_us / 1e6) if db else 0.0,
            dynamic=db is not None and config.batch_size > 0,
        )
        self._timeout_s = db.default_timeout_us / 1e6 if db and db.default_timeout_us else None
        self._allow_override = db.allow_timeout_override if db else True
        size = db.max_queue_size if db and db.max_queue_size else max_queue_size
        self.batcher = DynamicBatcher(
            f"{config.name}:{version}", instances, policy, size, self.stats
        )

    @classmethod
    async def load(
        cls,
        config: ModelConfig,
        version_dir: Path,
        server: ServerConfig,
        budget: memory.MemoryBudget | None = None,
        required_instances: int = 1,
    ) -> ModelVersion:
        """Create the instances one by one, each on its own thread, within the budget.

        Each instance is measured while it is built and warmed up (see
        :mod:`appliance.memory`); instances are admitted while they fit the budget
        and the model's own ``memory_limit``. Fewer than ``required_instances`` (one,
        or during a hot swap what the old copy had) is a refusal: everything made is
        closed, the charge released, and INVALID_ARG raised naming the budget, what
        is in use and what was needed. Warm-up failures fail the load the same way.
        """
        budget = budget or memory.MemoryBudget(None)
        backend, path = resolve_backend(config, version_dir)
        requested = config.instance_count
        # each instance's share of the cores, unless the config pins it
        pinned = config.parameters.get("intra_op_thread_count", "0")
        if not pinned.isdigit():
            raise ConfigError(
                config.source,
                "parameters.intra_op_thread_count",
                f"expected a positive integer, got {pinned!r}",
            )
        threads = int(pinned) or cpu_share(requested)
        kind = config.instance_group[0].kind
        share_group = f"{config.name}:{version_dir.name}:{next(_LOADS)}"
        version = int(version_dir.name)
        declared_in, declared_out = declared_tensors(config)
        config_json = json.dumps(to_triton_json(config))

        def factory(index: int) -> backends.Backend:
            return backends.create(
                backend,
                BackendOptions(
                    model_path=path,
                    instance_index=index,
                    instance_count=requested,
                    kind=kind,
                    threads=threads,
                    parameters=config.parameters,
                    max_batch_size=config.max_batch_size,
                    share_group=share_group,
                    inputs=declared_in,
                    outputs=declared_out,
                    model_config=config_json,
                    config_source=config.source,
                ),
            )

        started = time.perf_counter()
        admission = memory.Admission(budget, config.name, config.memory_limit)
        made: list[ModelInstance] = []
        try:
            async with budget.measuring():
                known = budget.estimate(config.name, version)
                guess = known[0].total if known else path.stat().st_size
                if not admission.fits(guess):
                    raise memory.BudgetRefused(admission.refusal("one instance (estimated)", guess))
                made.append(await ModelInstance.start(config.name, 0, factory))
                first = made[0].backend
                platform = config.platform or next(
                    (p for p, b in backends.PLATFORMS.items() if b == backend), ""
                )
                completed = complete(
                    replace(
                        config, backend=backend, platform=platform, default_model_filename=path.name
                    ),
                    first.inputs,
                    first.outputs,
                    # capped by the engine's own limit (a TensorRT optimization profile)
                    backends.auto_max_batch_size(first, server.default_max_batch_size),
                )
                samples = warmup.samples(completed, version_dir.parent)
                outputs = [t.name for t in completed.outputs]
                first_cost, working = await _warm(made[0], samples, outputs, config.name)
                if not admission.fits(first_cost.total):
                    raise memory.BudgetRefused(admission.refusal("one instance", first_cost.total))
                admission.add(first_cost)
                # what one more instance needs at least: its working memory (weights may
                # be shared); once one was measured, what that one really cost
                extra = working
                while len(made) < requested and admission.fits(extra.total):
                    made.append(await ModelInstance.start(config.name, len(made), factory))
                    cost, _ = await _warm(made[-1], samples, outputs, config.name)
                    cost = cost.at_least(working)
                    if not admission.fits(cost.total):
                        await made.pop().close()
                        break
                    admission.add(cost)
                    extra = cost
            if len(made) < required_instances:
                raise memory.BudgetRefused(
                    admission.refusal(
                        f"{required_instances} instance(s) (as many as the copy it replaces)",
                        admission.held.total + extra.total * (required_instances - len(made)),
                    )
                )
        except BaseException:
            budget.release(admission.owner)
            await InstanceGroup(made).close()
            raise
        count = len(made)
        if count < requested:
            log.warning(
                "model '%s' version %d: %d of %d instance(s) admitted: %s",
                config.name,
                version,
                count,
                requested,
                admission.refusal("another instance", extra.total),
            )
        budget.remember(config.name, version, first_cost, extra, count)
        log.info(
            "loaded model '%s' version %d: %d instance(s) x %d thread(s), backend %s, "
            "max_batch_size %d, memory %s (first instance %s, each further %s), in %.2fs",
            config.name,
            version,
            count,
            threads,
            backend,
            completed.batch_size,
            memory.fmt(admission.held.total),
            memory.fmt(first_cost.total),
            memory.fmt(extra.total),
            time.perf_counter() - started,
        )
        effective = replace(completed, instance_group=_trimmed(completed.instance_group, count))
        return cls(
            effective,
            version,
            InstanceGroup(made),
            server.default_max_queue_size,
            admission.held,
            budget,
            admission.owner,
            requested,
        )

    # ---- requests ---------------------------------------------------------------------

    def _check_input(self, name: str, arr: np.ndarray, spec: TensorConfig) -> int:
        """Validate one input; return its batch size (0 when the model doesn't batch)."""
        where = f"input '{name}' of model '{self.config.name}'"
        got = datatypes.from_numpy_dtype(arr.dtype)
        if got != spec.datatype:
            raise invalid(f"{where}: expected datatype {spec.datatype}, got {got}")
        batched = self.config.batch_size > 0
        expected = ([-1] if batched else []) + list(spec.dims)
        shape = list(arr.shape)
        if len(shape) != len(expected) or any(
            e not in (-1, s) for e, s in zip(expected, shape, strict=True)
        ):
            raise invalid(f"{where}: expected shape {expected}, got {shape}")
        if not batched:
            return 0
        rows = int(shape[0])
        if not 1 <= rows <= self.config.batch_size:
            raise invalid(
                f"{where}: batch size {rows} is outside 1..{self.config.batch_size} "
                f"(max_batch_size)"
            )
        return rows

    def _prepare(self, request: InferenceRequest) -> tuple[tuple[str, ...], int, Any, float | None]:
        for name in request.inputs:
            if name not in self._inputs:
                raise invalid(
                    f"model '{self.config.name}' has no input '{name}'; "
                    f"its inputs are {sorted(self._inputs)}"
                )
        rows: set[int] = set()
        for name, spec in self._inputs.items():
            arr = request.inputs.get(name)
            if arr is None:
                if not spec.optional:
                    raise invalid(
                        f"model '{self.config.name}' expects input '{name}', "
                        f"which the request lacks"
                    )
                continue
            rows.add(self._check_input(name, arr, spec))
        if len(rows) > 1:
            raise invalid(
                f"inputs of model '{self.config.name}' disagree on the batch size: {sorted(rows)}"
            )
        for name in request.outputs:
            if name not in self._outputs:
                raise invalid(
                    f"model '{self.config.name}' has no output '{name}'; "
                    f"its outputs are {list(self._outputs)}"
                )
        outputs = request.outputs or self._outputs
        # requests whose non-batch shapes differ must never share a batch
        signature = tuple((n, a.shape[1:]) for n, a in sorted(request.inputs.items()))
        timeout = self._timeout_s
        if request.timeout_us and self._allow_override:
            timeout = request.timeout_us / 1e6
        return outputs, max(rows.pop(), 1), signature, timeout

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        """Validate, queue, and wait for the result; records success/failure stats."""
        start = time.perf_counter_ns()
        try:
            outputs, rows, signature, timeout = self._prepare(request)
            result = await self.batcher.submit(request.inputs, outputs, rows, signature, timeout)
        except ApplianceError as exc:
            self.stats.record_failure(exc.reason, time.perf_counter_ns() - start)
            raise
        except asyncio.CancelledError:  # the caller went away (e.g. an in-process timeout)
            self.stats.record_failure(FailureReason.CANCELED, time.perf_counter_ns() - start)
            raise
        self.stats.record_success(
            time.perf_counter_ns() - start,
            result.queue_ns,
            result.input_ns,
            result.infer_ns,
            result.output_ns,
        )
        return InferenceResponse(self.config.name, str(self.version), result.outputs, request.id)

    def metadata(self, versions: list[str]) -> dict[str, Any]:
        """KServe v2 model metadata."""
        batch = [-1] if self.config.batch_size > 0 else []

        def tensor(t: TensorConfig) -> dict[str, Any]:
            return {"name": t.name, "datatype": t.datatype, "shape": batch + list(t.dims)}

        return {
            "name": self.config.name,
            "versions": versions,
            "platform": self.config.platform,
            "inputs": [tensor(t) for t in self.config.inputs],
            "outputs": [tensor(t) for t in self.config.outputs],
        }

    async def unload(self, timeout_s: float) -> None:
        """Drain queued and running requests (up to ``timeout_s``), free the instances,
        hand the freed heap back to the OS and the charge back to the budget."""
        self.state = State.UNLOADING
        budget = self._budget or memory.MemoryBudget(None)
        try:
            await self.batcher.stop(timeout_s)
            # not while another copy is being measured: memory freed meanwhile would
            # make that copy look cheaper than it is
            async with budget.measuring():
                await self._instances.close()
                await asyncio.to_thread(memory.trim)
        finally:
            self.state = State.UNAVAILABLE
            budget.release(self._owner)


async def _warm(
    instance: ModelInstance, samples: list[warmup.Sample], outputs: list[str], model: str
) -> tuple[memory.Usage, memory.Usage]:
    """Warm ``instance`` up; return (its whole cost, the part the warm-up added).

    The engine's own report counts where RSS and NVML are blind (GPU memory on a
    Jetson, for one).
    """
    _, working = await instance.run_measured(warmup.run, model, outputs, samples)
    cost = instance.created + working
    reported = memory_usage(instance.backend)
    if reported is not None:
        cost = cost.at_least(memory.Usage(reported.cpu_bytes, reported.gpu_bytes))
    return cost, working
