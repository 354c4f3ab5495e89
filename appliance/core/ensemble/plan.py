"""An ensemble's steps checked at load into a plan: the order they can run in and
which steps fan out.

The batch dimension is carried as Triton carries it: each tensor remembers whether
it came from something that batches (the ensemble's own inputs when the ensemble
batches, a batching step's outputs), and at load a tensor fits a step's input when
the dims agree, or the full dims agree (the batch dim as ``-1`` on the side that
batches: ``[-1, 16]`` from a model that does not batch fits ``[16]`` of one that
does). At run time :func:`carried_shape` (Triton's ``ReshapeTensorDims``) adds a
batch dim of 1 where a tensor from a non-batching source meets a batching step whose
dims it already matches, and drops a batch dim of 1 going the other way; an ensemble
output without labels of its own answers classification with the labels of the step
output it comes from.

Validation runs against the step models' configs as loaded then: unknown models,
tensors no step or input provides, model tensors a map names that do not exist,
datatype and dims mismatches, outputs produced twice, and cycles are config errors
naming the step. The step models must load first (:mod:`appliance.core.lifecycle`
loads ensembles after every other model).

Fan-out (an extension; Triton has none): in an ensemble that does not batch
(``max_batch_size: 0``) a tensor with one leading dim more than a batching step
model's input (``[-1, 3, 32, 128]`` into a recogniser of ``[3, 32, 128]``, the crops
a detector found) feeds that model its rows as batch items. Triton feeds such a
tensor as one request and refuses more rows than the model's ``max_batch_size``;
here the rows are sent in chunks of at most that many (each queued and batched in
the model's own batcher, with other callers' rows) and the outputs gathered back in
row order, each output with the same leading dim. Every input of such a step must
carry it. ``parameters: {max_fan_out: "N"}`` of the ensemble bounds the rows one
request may fan out (default :data:`MAX_FAN_OUT`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from appliance.backends.parameters import Parameters
from appliance.config.ensemble_config import EnsembleStep
from appliance.config.fields import ConfigError
from appliance.config.model_config import ModelConfig, TensorConfig
from appliance.core.servable import Servable
from appliance.errors import ApplianceError

# (model name, version or "") -> the version serving it; raises NOT_FOUND/UNAVAILABLE
Resolver = Callable[[str, str], Servable]
MAX_FAN_OUT = 1024  # rows one request may fan out to a step, unless the config says


@dataclass(frozen=True, slots=True)
class Plan:
    """What :func:`plan` found: the steps whose inputs' rows fan out, and the most rows
    one request may fan out."""

    fan_out: frozenset[int]
    max_fan_out: int
    # ensemble output -> the labels of the step output it comes from (Triton's)
    labels: dict[str, tuple[str, ...]]
    # decoupled steps (0..N responses a request, a decoupled ensemble among them); each
    # step's context: the decoupled step its inputs come from (it runs once for each
    # response of that step), None for the request itself; the outputs' context
    decoupled: frozenset[int] = frozenset()
    context: tuple[int | None, ...] = ()
    out_context: int | None = None


def step_version(step: EnsembleStep) -> str:
    return "" if step.model_version < 0 else str(step.model_version)


def _dims_agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == -1 or y == -1 or x == y for x, y in zip(a, b, strict=True))


def _full(dims: tuple[int, ...], batching: bool) -> tuple[int, ...]:
    return (-1, *dims) if batching else dims


def carried_shape(
    dims: tuple[int, ...], batching: bool, tensor_batch: int, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """The shape a tensor takes into a step (or out of the ensemble) whose config says
    ``dims`` and batches or not (Triton's ``ReshapeTensorDims``). ``tensor_batch``: the
    batch size of the request that made the tensor, 0 where that did not batch."""
    if batching == (tensor_batch != 0):
        return shape
    if batching:  # from a source that does not batch: already a batch, unless it fits dims
        return (1, *shape) if _dims_agree(dims, shape) else shape
    if tensor_batch == 1 and not _dims_agree(dims, shape):
        return shape[1:]
    return shape


def _step_configs(config: ModelConfig, resolve: Resolver) -> list[ModelConfig]:
    """Each step's model config, with the checks that need no other step."""
    src = config.source
    found = []
    for i, step in enumerate(config.ensemble_steps):
        where = f"ensemble_scheduling.step[{i}]"
        try:
            step_config = resolve(step.model_name, step_version(step)).config
        except ApplianceError as exc:
            raise ConfigError(src, where + ".model_name", str(exc)) from None
        if 0 < step_config.batch_size < config.batch_size:
            raise ConfigError(
                src,
                where,
                f"ensemble {config.name} allows maximum batch size {config.batch_size}, "
                f"but it contains model {step.model_name} which only allows maximum batch "
                f"size to be {step_config.batch_size}",
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
        found.append(step_config)
    return found


def plan(config: ModelConfig, resolve: Resolver) -> Plan:
    """Raise ConfigError unless the steps form a well-typed DAG over loaded models;
    return which steps fan out."""
    src = config.source
    steps = config.ensemble_steps
    configs = _step_configs(config, resolve)
    inputs = {t.name for t in config.inputs}
    producer: dict[str, int] = {}
    for i, step in enumerate(steps):
        for tensor in step.output_map.values():
            if tensor in inputs or tensor in producer:
                raise ConfigError(
                    src,
                    f"ensemble_scheduling.step[{i}].output_map",
                    f"tensor '{tensor}' is already an ensemble input or another step's output",
                )
            producer[tensor] = i
    for i, step in enumerate(steps):
        for model_in, tensor in step.input_map.items():
            if tensor not in inputs and tensor not in producer:
                raise ConfigError(
                    src,
                    f"ensemble_scheduling.step[{i}].input_map.{model_in}",
                    f"tensor '{tensor}' is neither an ensemble input nor a step output",
                )
    batching = config.batch_size > 0
    # tensor -> its config and whether it comes from something that batches
    known: dict[str, tuple[TensorConfig, bool]] = {t.name: (t, batching) for t in config.inputs}
    labels: dict[str, tuple[str, ...]] = {}
    fan_out: set[int] = set()
    for wave in order(config):  # producers before readers: their dims are known
        for i in wave:
            lead = _reads(config, i, configs[i], known)
            if lead is not None:
                fan_out.add(i)
            outs = {t.name: t for t in configs[i].outputs}
            for model_out, tensor in steps[i].output_map.items():
                spec = outs[model_out]
                dims = spec.dims if lead is None else (lead, *spec.dims)
                batched = lead is None and configs[i].batch_size > 0
                known[tensor] = (TensorConfig(tensor, spec.datatype, dims), batched)
                labels[tensor] = spec.labels
    for out in config.outputs:
        have, batched = known.get(out.name, (None, False))
        if have is None or out.name not in producer:
            raise ConfigError(src, f"output '{out.name}'", "no step produces this tensor")
        if have.datatype != out.datatype or not (
            _dims_agree(have.dims, out.dims)
            or _dims_agree(_full(have.dims, batched), _full(out.dims, batching))
        ):
            raise ConfigError(
                src,
                f"output '{out.name}'",
                f"config says {out.datatype} {list(out.dims)} but the step produces "
                f"{have.datatype} {list(have.dims)}",
            )
    try:
        limit = Parameters(config.name, config.parameters).integer(
            ("max_fan_out",), MAX_FAN_OUT, minimum=1
        )
    except ApplianceError as exc:
        raise ConfigError(src, "parameters.max_fan_out", exc.message) from None
    inherited = {t.name: labels[t.name] for t in config.outputs if not t.labels and labels[t.name]}
    decoupled = frozenset(i for i, c in enumerate(configs) if c.decoupled)
    for i in decoupled & fan_out:
        raise ConfigError(
            src,
            f"ensemble_scheduling.step[{i}]",
            f"model '{steps[i].model_name}' is decoupled: its rows cannot fan out",
        )
    context, out_context = _contexts(config, decoupled)
    return Plan(frozenset(fan_out), limit, inherited, decoupled, context, out_context)


def _contexts(
    config: ModelConfig, decoupled: frozenset[int]
) -> tuple[tuple[int | None, ...], int | None]:
    """Where each tensor comes from, as Triton tracks it: the nearest decoupled step
    upstream (None: the request). A step's inputs, and the ensemble's outputs, must
    come from one such step at most (Triton's text where they do not)."""
    steps = config.ensemble_steps
    origin: dict[str, int | None] = {t.name: None for t in config.inputs}
    context: dict[int, int | None] = {}

    def one(tensors: list[str], who: str) -> int | None:
        found = {origin[t] for t in tensors if t in origin} - {None}
        if len(found) > 1:
            raise ConfigError(
                config.source,
                "ensemble_scheduling",
                f"in ensemble {config.name}, step of model '{who}' receives inputs "
                "originated from different decoupled models",
            )
        return found.pop() if found else None

    for wave in order(config):
        for i in wave:
            context[i] = one(list(steps[i].input_map.values()), steps[i].model_name)
            for tensor in steps[i].output_map.values():
                origin[tensor] = i if i in decoupled else context[i]
    out = one([t.name for t in config.outputs], config.name)
    return tuple(context[i] for i in range(len(steps))), out


def _reads(
    config: ModelConfig,
    i: int,
    step_config: ModelConfig,
    known: dict[str, tuple[TensorConfig, bool]],
) -> int | None:
    """Check what step ``i`` reads against its model's inputs; return the leading dim
    its inputs' rows fan out over (-1: any count), or None when it does not fan out."""
    step = config.ensemble_steps[i]
    ins = {t.name: t for t in step_config.inputs}
    fanned: dict[str, int] = {}
    plain: list[str] = []
    batches = step_config.batch_size > 0
    for model_in, tensor in step.input_map.items():
        (have, batched), want = known[tensor], ins[model_in]
        where = f"ensemble_scheduling.step[{i}].input_map.{model_in}"
        mismatch = (
            f"tensor '{tensor}' is {have.datatype} {list(have.dims)} but model "
            f"'{step.model_name}' input '{model_in}' expects {want.datatype} {list(want.dims)}"
        )
        if have.datatype != want.datatype:
            raise ConfigError(config.source, where, mismatch)
        if _dims_agree(have.dims, want.dims):
            plain.append(model_in)
            continue
        rows = len(have.dims) == len(want.dims) + 1 and _dims_agree(have.dims[1:], want.dims)
        fans = rows and batches and not batched and config.batch_size == 0
        if not fans and _dims_agree(_full(have.dims, batched), _full(want.dims, batches)):
            plain.append(model_in)  # the batch dim carried (Triton's full dims)
            continue
        if not rows:
            raise ConfigError(config.source, where, mismatch)
        if step_config.batch_size == 0:
            raise ConfigError(
                config.source,
                where,
                f"{mismatch}; its leading dim of rows can fan out only to a model that "
                "batches (max_batch_size > 0)",
            )
        if config.batch_size > 0:
            raise ConfigError(
                config.source,
                where,
                f"{mismatch}; fanning rows out to a step needs an ensemble that does not "
                "batch (max_batch_size: 0)",
            )
        if batched:  # a batching step's output: its rows sit behind the batch dim
            raise ConfigError(config.source, where, mismatch)
        fanned[model_in] = have.dims[0]
    if not fanned:
        return None
    if plain:
        raise ConfigError(
            config.source,
            f"ensemble_scheduling.step[{i}].input_map",
            f"model '{step.model_name}' gets the rows of {sorted(fanned)} as its batch, but "
            f"input(s) {plain} have no leading dim of rows: every input of a step that "
            "fans out needs one",
        )
    leads = set(fanned.values())
    return leads.pop() if len(leads) == 1 else -1


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
