"""Loading one version: resolve its backend, build it, complete its config, log it.

The lifecycle asks :func:`load` for a servable and never looks at the platform
itself. A plain model version is built in four steps, each owned elsewhere:
which backend and file serve it (:func:`resolve_backend`), the backend options
every instance gets (:func:`backend_factory`), how many instances the memory
budget admits (:func:`appliance.core.instances.start_within_budget`), and the config
completed from the first instance's declared tensors (:func:`complete_from`;
:func:`completed_config` does the same outside a load, for ``bundle build``).
An ensemble is validated against the loaded step models instead.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from appliance import backends, names
from appliance.backends import process_host
from appliance.backends.base import BackendOptions, TensorSpec, memory_usage
from appliance.backends.parameters import Parameters
from appliance.config.completion import complete
from appliance.config.fields import ConfigError
from appliance.config.model_config import InstanceGroup as GroupConfig
from appliance.config.model_config import ModelConfig, TensorConfig
from appliance.config.sequence_config import implicit_inputs, implicit_outputs
from appliance.config.server_config import ServerConfig
from appliance.config.triton_config import to_triton_json
from appliance.core import memory, warmup
from appliance.core.ensemble.runner import EnsembleVersion, Resolver
from appliance.core.instances import ModelInstance, Warm, cpu_share, start_within_budget
from appliance.core.model import ModelVersion
from appliance.core.rate_limiter import RateLimiter
from appliance.core.sequence.feed import load_initial_states, warmup_inputs
from appliance.core.servable import Servable
from appliance.errors import invalid

log = logging.getLogger(__name__)

_LOADS = itertools.count(1)  # share groups: one per loaded copy


def loads_after_others(config: ModelConfig) -> bool:
    """Whether ``config`` is built from other loaded models (an ensemble), so it
    must load after them."""
    return config.platform == "ensemble"


async def load(
    config: ModelConfig,
    version_dir: Path,
    server: ServerConfig,
    budget: memory.MemoryBudget,
    required_instances: int,
    resolve: Resolver,
    limiter: RateLimiter | None = None,
) -> Servable:
    """Build the servable for one version folder (see the module docstring)."""
    if loads_after_others(config):
        return EnsembleVersion.load_ensemble(config, version_dir, server, resolve)
    return await load_model_version(
        config, version_dir, server, budget, required_instances, limiter
    )


def resolve_backend(
    config: ModelConfig, version_dir: Path, allow_links: bool = False
) -> tuple[str, Path]:
    """Which backend serves this version and from which file: a file of the version
    folder that, links followed, lies inside the repository (the folder's
    grandparent) unless ``allow_links``."""
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
    if name in backends.FILELESS:  # the config is the model: no file to find or confine
        return name, version_dir / name
    path = version_dir / (filename or backends.DEFAULT_FILENAMES[name])
    if not path.exists():
        raise invalid(
            f"model '{config.name}' version {version_dir.name}: model file {path} does not exist"
        )
    what = f"model '{config.name}' version {version_dir.name}: model file {path.name!r}"
    return name, names.confine(version_dir.parent.parent, path, allow_links, what)


def declared_tensors(
    config: ModelConfig,
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The config's tensors as engine specs (batch dim -1 where the model batches)."""
    batch = (-1,) if config.batch_size > 0 else ()

    def specs(
        tensors: tuple[TensorConfig, ...], implicit: dict[str, tuple[str, tuple[int, ...]]]
    ) -> tuple[TensorSpec, ...]:
        declared = [
            TensorSpec(t.name, t.datatype, batch + t.model_dims, t.optional) for t in tensors
        ]
        # the sequence batcher's control and state tensors are the model's too
        declared += [TensorSpec(n, d, batch + dims) for n, (d, dims) in implicit.items()]
        return tuple(declared)

    sb = config.sequence_batching
    return specs(config.inputs, implicit_inputs(sb)), specs(config.outputs, implicit_outputs(sb))


def thread_share(config: ModelConfig) -> tuple[int, int]:
    """Intra-op threads (for an engine of each instance's own, for one engine the
    instances share). ``parameters.intra_op_thread_count`` pins both. Else engines of
    their own split the cores equally (N of them run at once on their own pools), and
    a shared engine gets every core: its one pool serves whichever instances are busy,
    so a lone busy instance runs on all the cores and N busy ones share them."""
    pinned = Parameters(config.name, config.parameters).integer(("intra_op_thread_count",), 0)
    if pinned:
        return pinned, pinned
    return cpu_share(config.instance_count), cpu_share(1)


def backend_factory(
    config: ModelConfig,
    backend: str,
    path: Path,
    threads: tuple[int, int],
    share_group: str,
    key_file: Path | None = None,
) -> Callable[[int], backends.Backend]:
    """Instance index -> a new backend object built with this version's options."""
    declared_in, declared_out = declared_tensors(config)
    config_json = json.dumps(to_triton_json(config))
    kind = config.instance_group[0].kind
    if kind == "KIND_MODEL" and backend != "python":
        kind = "KIND_AUTO"  # Triton's "the model places itself": an engine picks as AUTO does

    def factory(index: int) -> backends.Backend:
        # in this process, or in a worker process (parameters: {execution: process})
        return process_host.create(
            backend,
            BackendOptions(
                model_path=path,
                instance_index=index,
                instance_count=config.instance_count,
                kind=kind,
                threads=threads[0],
                shared_threads=threads[1],
                parameters=config.parameters,
                max_batch_size=config.max_batch_size,
                share_group=share_group,
                inputs=declared_in,
                outputs=declared_out,
                model_config=config_json,
                config_source=config.source,
                key_file=key_file,
            ),
        )

    return factory


def complete_from(
    config: ModelConfig, engine: backends.Backend, backend: str, path: Path, server: ServerConfig
) -> ModelConfig:
    """Triton's auto-complete: the config filled in from the first instance's tensors."""
    platform = config.platform or next(
        (p for p, b in backends.PLATFORMS.items() if b == backend), ""
    )
    # an engine that answers 0..N times a request (a language model) makes the model
    # decoupled whether or not its config says so
    decoupled = config.decoupled or bool(getattr(engine, "decoupled", False))
    return complete(
        replace(
            config,
            backend=backend,
            platform=platform,
            default_model_filename=path.name,
            decoupled=decoupled,
        ),
        engine.inputs,
        engine.outputs,
        # capped by the engine's own limit (a TensorRT optimization profile)
        backends.auto_max_batch_size(engine, server.default_max_batch_size),
    )


def completed_config(config: ModelConfig, version_dir: Path, server: ServerConfig) -> ModelConfig:
    """The config ``version_dir`` would serve with: ``config`` completed as a load
    completes it (:func:`resolve_backend`, one engine built with the load's options,
    :func:`complete_from`), the engine closed again. For tools that ship a config
    (``bundle build`` of a folder without one), so that what they ship is what the
    server would have made of the folder."""
    backend, path = resolve_backend(config, version_dir, server.allow_symlinked_models)
    share_group = f"{config.name}:{version_dir.name}:{next(_LOADS)}"
    factory = backend_factory(config, backend, path, (1, 1), share_group, server.model_key_file)
    engine = factory(0)
    try:
        return complete_from(config, engine, backend, path, server)
    finally:
        engine.close()


async def load_model_version(
    config: ModelConfig,
    version_dir: Path,
    server: ServerConfig,
    budget: memory.MemoryBudget | None = None,
    required_instances: int = 1,
    limiter: RateLimiter | None = None,
) -> ModelVersion:
    """Build a READY model version: as many instances as the budget admits (at least
    ``required_instances``, see :func:`appliance.core.instances.start_within_budget`),
    each warmed up, and the config completed from the engine."""
    budget = budget or memory.MemoryBudget(None)
    backend, path = resolve_backend(config, version_dir, server.allow_symlinked_models)
    threads = thread_share(config)
    version = int(version_dir.name)
    share_group = f"{config.name}:{version_dir.name}:{next(_LOADS)}"
    factory = backend_factory(config, backend, path, threads, share_group, server.model_key_file)
    completed = config
    probe_failures: list[str] = []  # per instance warmed: why the memory probe failed

    async def prepare(first: ModelInstance) -> Warm:
        nonlocal completed
        completed = complete_from(config, first.backend, backend, path, server)
        completed = load_initial_states(completed, version_dir.parent)
        samples = [
            _with_sequence_inputs(s, completed)
            for s in warmup.samples(completed, version_dir.parent, server.allow_symlinked_models)
        ]
        outputs = [t.name for t in completed.outputs]

        async def warm(instance: ModelInstance) -> tuple[memory.Usage, memory.Usage]:
            cost, working, failure = await _warm(instance, samples, outputs, config.name)
            probe_failures.append(failure)
            return cost, working

        return warm

    started = time.perf_counter()

    def guess() -> int:  # read under the measuring lock: another load may be remembering
        known = budget.estimate(config.name, version)
        if known:
            return known[0].total
        return backends.estimate(backend, path, config.parameters, config.source)

    admission = memory.Admission(budget, config.name, config.memory_limit)
    admitted = await start_within_budget(
        admission,
        config.name,
        factory,
        config.instance_count,
        required_instances,
        guess,
        prepare,
    )
    count = len(admitted.group.instances)
    if count < config.instance_count:
        log.warning(
            "model '%s' version %d: %d of %d instance(s) admitted: %s",
            config.name,
            version,
            count,
            config.instance_count,
            admission.refusal("another instance", admitted.each_further.total),
        )
    budget.remember(config.name, version, admitted.first, admitted.each_further, count)
    log.info(
        "loaded model '%s' version %d: %d instance(s) x %d thread(s), backend %s, "
        "max_batch_size %d, memory %s (first instance %s, each further %s), in %.2fs",
        config.name,
        version,
        count,
        # what the engine reports (a shared ONNX Runtime session: its pool), else the share
        getattr(admitted.group.instances[0].backend, "threads", threads[0]),
        backend,
        completed.batch_size,
        memory.fmt(admitted.held.total),
        memory.fmt(admitted.first.total),
        memory.fmt(admitted.each_further.total),
        time.perf_counter() - started,
    )
    lower = warmup.lower_bound(completed, probe_failures[0] if probe_failures else "")
    if completed.decoupled and memory_usage(admitted.group.instances[0].backend) is not None:
        lower = ""  # not probed, but the engine reported what it holds
    if lower:
        log.warning(
            "model '%s' version %d: memory is a lower bound: declare a model_warmup at your "
            "largest input (%s; measured %s)",
            config.name,
            version,
            lower,
            memory.fmt(admitted.held.total),
        )
    effective = replace(completed, instance_group=_trimmed(completed.instance_group, count))
    try:
        served = ModelVersion(
            effective,
            version,
            admitted.group,
            server.default_max_queue_size,
            admitted.held,
            budget,
            admitted.owner,
            config.instance_count,
            limiter,
        )
    except BaseException:  # (the rate limiter cannot schedule its instances)
        budget.release(admitted.owner)
        await admitted.group.close()
        raise
    served.stats.memory_lower_bound = lower
    return served


def _with_sequence_inputs(sample: warmup.Sample, config: ModelConfig) -> warmup.Sample:
    """A warm-up sample of a sequence model also carries the server-fed tensors."""
    if config.sequence_batching is None:
        return sample
    rows = next((int(a.shape[0]) for a in sample.inputs.values() if a.ndim), 1)
    return replace(sample, inputs={**sample.inputs, **warmup_inputs(config, rows)})


def _trimmed(groups: tuple[GroupConfig, ...], admitted: int) -> tuple[GroupConfig, ...]:
    """The instance groups cut down to the ``admitted`` first instances."""
    out = []
    for g in groups:
        take = min(g.count, admitted)
        if take:
            out.append(replace(g, count=take))
        admitted -= take
    return tuple(out)


async def _warm(
    instance: ModelInstance, samples: list[warmup.Sample], outputs: list[str], model: str
) -> tuple[memory.Usage, memory.Usage, str]:
    """Warm ``instance`` up; return (its whole cost, the part the warm-up added, why
    the memory probe failed or "").

    The engine's own report counts where RSS and NVML are blind (GPU memory on a
    Jetson, for one).
    """
    failure, working = await instance.run_measured(warmup.run, model, outputs, samples)
    cost = instance.created + working
    reported = memory_usage(instance.backend)
    if reported is not None:
        cost = cost.at_least(memory.Usage(reported.cpu_bytes, reported.gpu_bytes))
    return cost, working, failure
