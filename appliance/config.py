"""Model and server configuration, validated once at the edge into typed objects.

Model configs use Triton's field names: ``config.yaml``, or Triton's own
``config.pbtxt`` (protobuf text format, read with protobuf's parser against
Triton's published ``ModelConfig`` schema, then validated by the same code as
YAML). Every error names the file, the field and what was expected, e.g.
``models/simple/config.yaml: input[0].dims: expected a list of integers >= -1,
got 'x'``. A config may leave inputs, outputs and max_batch_size
out; :func:`complete` fills them from what the engine declares, as Triton's
auto-complete does.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

from appliance import datatypes
from appliance.datatypes import TensorSpec
from appliance.fields import ConfigError, Fields, parse_limit, parse_size
from appliance.sequence_config import (
    CORRID,
    CORRID_TYPES,
    KINDS,
    START,
    Control,
    ImplicitState,
    SequenceBatching,
    implicit_inputs,
    implicit_outputs,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TensorConfig:
    name: str
    datatype: str  # KServe name
    dims: tuple[int, ...]  # without the batch dim; -1 = any size
    optional: bool = False
    # Triton's reshape: the shape the model sees (dims: what the client sees); None: dims
    reshape: tuple[int, ...] | None = None
    format: str = "FORMAT_NONE"  # inputs: FORMAT_NCHW / FORMAT_NHWC, reported back only
    label_filename: str = ""  # outputs: class labels for the classification extension
    labels: tuple[str, ...] = ()  # read from label_filename when the config is loaded

    @property
    def model_dims(self) -> tuple[int, ...]:
        """The dims the engine sees (``reshape`` where given)."""
        return self.dims if self.reshape is None else self.reshape


@dataclass(frozen=True, slots=True)
class DynamicBatching:
    preferred_batch_size: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    max_queue_size: int = 0  # 0 = the server's default bound (queues are never unbounded)
    default_timeout_us: int = 0  # 0 = no queue timeout
    allow_timeout_override: bool = True


@dataclass(frozen=True, slots=True)
class InstanceGroup:
    count: int = 1
    kind: str = "KIND_CPU"


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    kind: str = "latest"  # latest | all | specific
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        """Versions of ``available`` this policy serves, newest first."""
        newest = sorted(available, reverse=True)
        if self.kind == "all":
            return newest
        if self.kind == "specific":
            return [v for v in newest if v in self.versions]
        return newest[: self.num_versions]


@dataclass(frozen=True, slots=True)
class WarmupInput:
    """One input of a warm-up sample; ``dims`` exclude the batch dimension."""

    name: str
    datatype: str  # KServe name
    dims: tuple[int, ...]
    data: str  # zero | random | file
    file: str = ""  # input_data_file, relative to the model's warmup/ folder


@dataclass(frozen=True, slots=True)
class WarmupSample:
    """Triton's ``model_warmup`` entry: run ``count`` times before the model is READY."""

    name: str
    batch_size: int
    inputs: tuple[WarmupInput, ...]
    count: int = 1


@dataclass(frozen=True, slots=True)
class EnsembleStep:
    """One step of Triton's ``ensemble_scheduling``: which model runs, and how its
    tensor names map to the ensemble's (``input_map``: model input -> ensemble tensor,
    ``output_map``: model output -> ensemble tensor)."""

    model_name: str
    model_version: int  # -1: the newest ready version
    input_map: dict[str, str]
    output_map: dict[str, str]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    backend: str = ""
    platform: str = ""
    max_batch_size: int | None = None  # None until completed from the model
    inputs: tuple[TensorConfig, ...] = ()
    outputs: tuple[TensorConfig, ...] = ()
    dynamic_batching: DynamicBatching | None = None
    instance_group: tuple[InstanceGroup, ...] = (InstanceGroup(),)
    version_policy: VersionPolicy = VersionPolicy()
    default_model_filename: str = ""
    parameters: dict[str, str] = field(default_factory=dict)
    model_warmup: tuple[WarmupSample, ...] = ()
    memory_limit: int | None = None  # parameters.memory_limit: one copy's cap, bytes
    # parameters.max_queued_bytes: bytes this model's queued requests may hold (None:
    # the server's max_queued_bytes_per_model; see appliance.queue_bytes)
    max_queued_bytes: int | None = None
    ensemble_steps: tuple[EnsembleStep, ...] = ()  # platform "ensemble" only
    sequence_batching: SequenceBatching | None = None  # stateful models
    decoupled: bool = False  # model_transaction_policy.decoupled: 0..N responses a request
    source: str = "<auto-complete>"

    @property
    def batch_size(self) -> int:
        return self.max_batch_size or 0

    @property
    def instance_count(self) -> int:
        return sum(g.count for g in self.instance_group)


# Triton fields accepted but not acted on yet: warned about, never silently dropped.
_UNSUPPORTED = {
    "optimization",
    "response_cache",
    "batch_input",
    "batch_output",
    "model_operations",
    "model_repository_agents",
    "runtime",
    "cc_model_filenames",
    "metric_tags",
    "model_metrics",
}
_MODEL_FIELDS = {
    "name",
    "backend",
    "platform",
    "max_batch_size",
    "input",
    "output",
    "dynamic_batching",
    "instance_group",
    "version_policy",
    "default_model_filename",
    "parameters",
    "model_warmup",
    "ensemble_scheduling",
    "sequence_batching",
    "model_transaction_policy",
} | _UNSUPPORTED


# Triton tensor fields accepted but not acted on yet (warned about, like model fields).
_UNSUPPORTED_TENSOR = (
    "is_shape_tensor",
    "allow_ragged_batch",
    "is_non_linear_format_io",
)


def _tensor(f: Fields) -> TensorConfig:
    f.check_keys(
        {"name", "data_type", "dims", "optional", "format", "reshape", "label_filename"}
        | set(_UNSUPPORTED_TENSOR)
    )
    name = f.text("name")
    if not name:
        raise f.fail("name", "expected a non-empty tensor name")
    raw_type = f.text("data_type")
    try:
        datatype = datatypes.from_config_type(raw_type)
    except ValueError:
        expected = ", ".join(datatypes.to_config_type(d) for d in datatypes.DATATYPES)
        raise f.fail("data_type", f"expected one of {expected}, got {raw_type!r}") from None
    for key in _UNSUPPORTED_TENSOR:
        if key in f.data:
            log.warning("%s: %s: '%s' is not supported and is ignored", f.source, f.path, key)
    reshape = f.sub("reshape")
    if reshape is not None:
        reshape.check_keys({"shape"})
    fmt = f.text("format", "FORMAT_NONE")
    if fmt not in _FORMATS:
        raise f.fail("format", f"expected one of {', '.join(_FORMATS)}, got {fmt!r}")
    label_file = f.file_name("label_filename")  # a file of the model folder, never a path
    dims = f.ints("dims", -1)
    shape = reshape.ints("shape", -1) if reshape is not None else None
    if shape is not None and -1 not in (*dims, *shape) and math.prod(dims) != math.prod(shape):
        raise f.fail(
            "reshape", f"shape {list(shape)} does not hold the elements of dims {list(dims)}"
        )
    return TensorConfig(
        name,
        datatype,
        dims,
        f.flag("optional", False),
        # protobuf JSON leaves an empty shape out: "reshape: { shape: [] }" is {}
        shape,
        fmt,
        label_file,
    )


_FORMATS = ("FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW")


def _transaction_policy(f: Fields) -> bool:
    policy = f.sub("model_transaction_policy")
    if policy is None:
        return False
    policy.check_keys({"decoupled"})
    return policy.flag("decoupled", False)


def _dynamic_batching(f: Fields) -> DynamicBatching:
    f.check_keys(
        {
            "preferred_batch_size",
            "max_queue_delay_microseconds",
            "default_queue_policy",
            "preserve_ordering",
            "priority_levels",
            "default_priority_level",
            "priority_queue_policy",
        }
    )
    ignored = ("preserve_ordering", "priority_levels", "default_priority_level")
    for key in (*ignored, "priority_queue_policy"):
        if key in f.data:
            log.warning("%s: %s: '%s' is not supported and is ignored", f.source, f.path, key)
    policy = f.sub("default_queue_policy")
    size, timeout, override = 0, 0, True
    if policy is not None:
        policy.check_keys(
            {
                "max_queue_size",
                "default_timeout_microseconds",
                "allow_timeout_override",
                "timeout_action",
            }
        )
        size = policy.integer("max_queue_size", 0)
        timeout = policy.integer("default_timeout_microseconds", 0)
        override = policy.flag("allow_timeout_override", True)
        if policy.text("timeout_action", "REJECT") != "REJECT":
            raise policy.fail("timeout_action", "only REJECT is supported")
    return DynamicBatching(
        preferred_batch_size=f.ints("preferred_batch_size", 1),
        max_queue_delay_us=f.integer("max_queue_delay_microseconds", 0),
        max_queue_size=size,
        default_timeout_us=timeout,
        allow_timeout_override=override,
    )


def _version_policy(f: Fields) -> VersionPolicy:
    f.check_keys({"latest", "all", "specific"})
    if len(f.data) != 1:
        raise ConfigError(f.source, f.path, "expected exactly one of latest, all, specific")
    # test the key, not the value: YAML's bare "latest:" is None and means the defaults
    if "latest" in f.data:
        latest = f.sub("latest")
        if latest is None:
            return VersionPolicy("latest")
        latest.check_keys({"num_versions"})
        return VersionPolicy("latest", num_versions=latest.integer("num_versions", 1, minimum=1))
    if "specific" in f.data:
        specific = f.sub("specific")
        if specific is None:
            raise f.fail("specific", "expected a mapping with a 'versions' list")
        specific.check_keys({"versions"})
        versions = specific.ints("versions", 1)
        if not versions:
            raise specific.fail("versions", "expected at least one version number")
        return VersionPolicy("specific", versions=versions)
    return VersionPolicy("all")


def _parameters(f: Fields) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in f.data.items():
        if isinstance(value, dict) and set(value) == {"string_value"}:
            value = value["string_value"]  # Triton's {key: {string_value: ...}} form
        if not isinstance(value, (str, int, float, bool)):
            raise f.fail(str(key), f"expected a string value, got {value!r}")
        out[str(key)] = str(value)
    return out


def parse_model_config(data: Any, name: str, source: str) -> ModelConfig:
    """Validate a config mapping (as read from YAML or JSON) into a ModelConfig."""
    if data is None:
        data = {}
    f = Fields(source, data)
    f.check_keys(_MODEL_FIELDS)
    for key in sorted(_UNSUPPORTED & set(f.data)):
        log.warning("%s: field '%s' is not supported yet and is ignored", source, key)
    declared = f.text("name", name)
    if declared != name:
        raise f.fail("name", f"expected '{name}' (the model's folder name), got {declared!r}")
    groups = []
    for g in f.entries("instance_group"):
        g.check_keys(
            {"name", "count", "kind", "gpus", "host_policy", "profile", "passive"}
            | {"rate_limiter", "secondary_devices"}
        )
        for key in ("rate_limiter", "secondary_devices", "host_policy", "profile", "passive"):
            if key in g.data:
                log.warning("%s: %s: '%s' is not supported and is ignored", source, g.path, key)
        kind = g.text("kind", "KIND_CPU")
        if kind not in ("KIND_CPU", "KIND_GPU", "KIND_AUTO"):
            raise g.fail("kind", f"expected KIND_CPU, KIND_GPU or KIND_AUTO, got {kind!r}")
        groups.append(InstanceGroup(g.integer("count", 1, minimum=1), kind))
    db = f.sub("dynamic_batching")
    vp = f.sub("version_policy")
    params = f.sub("parameters")
    parameters = _parameters(params) if params is not None else {}
    max_batch = f.integer("max_batch_size", 0) if "max_batch_size" in f.data else None
    dynamic = (
        _dynamic_batching(db)
        if db is not None
        else (DynamicBatching() if "dynamic_batching" in f.data else None)
    )
    if dynamic is not None and max_batch:
        too_big = [n for n in dynamic.preferred_batch_size if n > max_batch]
        if too_big:
            raise f.fail(
                "dynamic_batching.preferred_batch_size",
                f"{too_big} exceed max_batch_size {max_batch}",
            )
    warmup = tuple(_warmup(w) for w in f.entries("model_warmup"))
    for i, w in enumerate(warmup):
        if max_batch is not None and w.batch_size > max(1, max_batch):
            raise f.fail(
                f"model_warmup[{i}].batch_size",
                f"{w.batch_size} exceeds max_batch_size {max_batch}"
                + ("" if max_batch else " (a model that does not batch warms up one sample)"),
            )
    steps = _ensemble(f)
    seq = f.sub("sequence_batching")
    if "sequence_batching" in f.data and ("dynamic_batching" in f.data or steps):
        raise f.fail(
            "sequence_batching",
            "a model has one scheduler: not also dynamic_batching or ensemble_scheduling",
        )
    if steps and max_batch is None:
        max_batch = 0  # Triton's default; config.pbtxt cannot spell an explicit 0
    if steps and not (f.data.get("input") and f.data.get("output")):
        raise f.fail(
            "ensemble_scheduling",
            "an ensemble has no engine to complete its config from: declare input and output",
        )
    inputs = tuple(_tensor(t) for t in f.entries("input"))
    outputs = tuple(_tensor(t) for t in f.entries("output"))
    sequence = (
        _sequence_batching(seq)
        if seq is not None
        else (SequenceBatching() if "sequence_batching" in f.data else None)
    )
    fed = set(implicit_inputs(sequence)) & {t.name for t in inputs}
    fed |= set(implicit_outputs(sequence)) & {t.name for t in outputs}
    if fed:
        raise f.fail(
            "sequence_batching",
            f"{sorted(fed)} are fed and kept by the sequence batcher (control or state "
            "tensors): leave them out of input and output",
        )
    return ModelConfig(
        name=name,
        backend=f.text("backend"),
        platform=f.text("platform"),
        max_batch_size=max_batch,
        inputs=inputs,
        outputs=outputs,
        dynamic_batching=dynamic,
        instance_group=tuple(groups) or (InstanceGroup(),),
        version_policy=_version_policy(vp) if vp is not None else VersionPolicy(),
        default_model_filename=f.file_name("default_model_filename"),
        parameters=parameters,
        model_warmup=warmup,
        memory_limit=_memory_limit(parameters, source),
        max_queued_bytes=_queued_bytes(parameters, source),
        ensemble_steps=steps,
        sequence_batching=sequence,
        decoupled=_transaction_policy(f),
        source=source,
    )


def _control(f: Fields) -> Control:
    f.check_keys({"name", "control"})
    name = f.text("name")
    controls = f.entries("control")
    if not name or len(controls) != 1:
        raise ConfigError(f.source, f.path, "expected a tensor 'name' and one 'control'")
    c = controls[0]
    c.check_keys({"kind", "int32_false_true", "fp32_false_true", "bool_false_true", "data_type"})
    kind = c.text("kind", START)  # protobuf leaves out its default (the first) kind
    if kind not in KINDS:
        raise c.fail("kind", f"expected one of {list(KINDS)}, got {kind!r}")
    if kind == CORRID:
        raw = c.text("data_type")
        datatype = datatypes.from_config_type(raw) if raw.startswith("TYPE_") else ""
        if datatype not in CORRID_TYPES:
            raise c.fail(
                "data_type",
                "expected TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING, "
                f"got {raw!r}",
            )
        return Control(name, kind, datatype)
    given = [k for k in ("int32_false_true", "fp32_false_true", "bool_false_true") if k in c.data]
    values = c.data.get(given[0]) if len(given) == 1 else None
    if not isinstance(values, list) or len(values) != 2:
        raise ConfigError(
            c.source,
            c.path,
            f"{kind} needs exactly one of int32_false_true, fp32_false_true, "
            "bool_false_true with two values (false, true)",
        )
    datatype = {"int32_false_true": "INT32", "fp32_false_true": "FP32"}.get(given[0], "BOOL")
    kinds = {"INT32": (int,), "FP32": (int, float), "BOOL": (bool,)}[datatype]
    typed = all(
        isinstance(v, kinds) and (datatype == "BOOL") == isinstance(v, bool) for v in values
    )
    if not typed:
        raise c.fail(given[0], f"expected two {datatype} values, got {values!r}")
    if datatype == "FP32":
        values = [float(v) for v in values]
    return Control(name, kind, datatype, (values[0], values[1]))


def _state(f: Fields) -> ImplicitState:
    f.check_keys(
        {"input_name", "output_name", "data_type", "dims", "initial_state"}
        | {"use_same_buffer_for_input_output", "use_growable_memory"}
    )
    names = (f.text("input_name"), f.text("output_name"))
    if not all(names):
        raise ConfigError(f.source, f.path, "a state needs 'input_name' and 'output_name'")
    raw = f.text("data_type")
    try:
        datatype = datatypes.from_config_type(raw)
    except ValueError:
        raise f.fail("data_type", f"expected a TYPE_* data type, got {raw!r}") from None
    dims = f.ints("dims", -1)
    if isinstance(f.data.get("initial_state"), dict):  # YAML may write the one entry bare
        entries = [Fields(f.source, f.data["initial_state"], f.at("initial_state"))]
    else:
        entries = f.entries("initial_state")
    if len(entries) > 1:
        raise f.fail("initial_state", f"must hold one entry or none, got {len(entries)}")
    if not entries:
        return ImplicitState(names[0], names[1], datatype, dims)
    i = entries[0]
    i.check_keys({"data_type", "dims", "zero_data", "data_file", "name"})
    if i.text("data_type", raw) != raw:
        raise i.fail("data_type", "does not match the state data type")
    if not i.text("name"):
        raise i.fail("name", "must be set when using initial_state")
    initial_dims = i.ints("dims", 0)
    if len(initial_dims) != len(dims) or any(
        d != -1 and d != n for d, n in zip(dims, initial_dims, strict=True)
    ):
        raise i.fail("dims", f"{list(initial_dims)} do not match the state dims {list(dims)}")
    if ("zero_data" in i.data) == ("data_file" in i.data):
        raise ConfigError(i.source, i.path, "expected one of zero_data or data_file")
    data_file = i.text("data_file") if "data_file" in i.data else ""
    if "data_file" in i.data and not data_file:
        raise i.fail("data_file", "expected a file name")
    return ImplicitState(
        names[0], names[1], datatype, dims, initial_dims, i.text("name"), data_file
    )


def _sequence_batching(f: Fields) -> SequenceBatching:
    f.check_keys(
        {"max_sequence_idle_microseconds", "control_input", "direct", "oldest", "state"}
        | {"iterative_sequence"}
    )
    if f.data.get("iterative_sequence"):
        raise f.fail("iterative_sequence", "iterative sequences are not supported")
    if "direct" in f.data and "oldest" in f.data:
        raise ConfigError(f.source, f.path, "expected one strategy: direct or oldest, not both")
    controls = tuple(_control(c) for c in f.entries("control_input"))
    kinds = [c.kind for c in controls]
    names = [c.name for c in controls]
    if len(set(kinds)) != len(kinds) or len(set(names)) != len(names):
        raise f.fail("control_input", "each control kind and tensor name may appear only once")
    states = tuple(_state(s) for s in f.entries("state"))
    state_inputs = [s.input_name for s in states]
    if len(set(state_inputs)) != len(state_inputs):
        raise f.fail("state", "a state input name is specified more than once")
    idle = f.integer("max_sequence_idle_microseconds", 0) or 1_000_000  # Triton's default
    oldest = f.sub("oldest")
    if "oldest" in f.data:
        o = oldest or Fields(f.source, {}, f.at("oldest"))
        o.check_keys(
            {"max_candidate_sequences", "preferred_batch_size", "max_queue_delay_microseconds"}
            | {"preserve_ordering"}
        )
        return SequenceBatching(
            "oldest",
            max_candidate_sequences=o.integer("max_candidate_sequences", 0),
            preferred_batch_size=o.ints("preferred_batch_size", 1),
            max_queue_delay_us=o.integer("max_queue_delay_microseconds", 0),
            max_sequence_idle_us=idle,
            controls=controls,
            states=states,
        )
    d = f.sub("direct") or Fields(f.source, {}, f.at("direct"))
    d.check_keys({"max_queue_delay_microseconds", "minimum_slot_utilization"})
    utilization = d.data.get("minimum_slot_utilization", 0.0)
    if (
        not isinstance(utilization, (int, float))
        or isinstance(utilization, bool)
        or not (0 <= utilization <= 1)
    ):
        raise d.fail("minimum_slot_utilization", f"expected a number in 0..1, got {utilization!r}")
    return SequenceBatching(
        "direct",
        max_queue_delay_us=d.integer("max_queue_delay_microseconds", 0),
        minimum_slot_utilization=float(utilization),
        max_sequence_idle_us=idle,
        controls=controls,
        states=states,
    )


def _string_map(f: Fields, key: str) -> dict[str, str]:
    value = f.data.get(key, {})
    if (
        not isinstance(value, dict)
        or not value
        or not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in value.items())
    ):
        raise f.fail(key, f"expected a non-empty mapping of tensor names, got {value!r}")
    return dict(value)


def _ensemble(f: Fields) -> tuple[EnsembleStep, ...]:
    """``ensemble_scheduling`` for platform ``ensemble`` (and only for it)."""
    is_ensemble = f.data.get("platform") == "ensemble"
    scheduling = f.sub("ensemble_scheduling")
    if scheduling is None:
        if is_ensemble:
            raise f.fail("ensemble_scheduling", "platform 'ensemble' needs ensemble_scheduling")
        return ()
    if not is_ensemble:
        raise f.fail("ensemble_scheduling", "only a model with platform 'ensemble' has steps")
    scheduling.check_keys({"step"})
    steps = []
    for s in scheduling.entries("step"):
        s.check_keys({"model_name", "model_version", "input_map", "output_map"})
        model = s.file_name("model_name", "model name")
        if not model:
            raise s.fail("model_name", "expected the name of the model this step runs")
        steps.append(
            EnsembleStep(
                model,
                s.integer("model_version", -1, minimum=-1),
                _string_map(s, "input_map"),
                _string_map(s, "output_map"),
            )
        )
    if not steps:
        raise scheduling.fail("step", "expected at least one step")
    return tuple(steps)


def _memory_limit(parameters: dict[str, str], source: str) -> int | None:
    if "memory_limit" not in parameters:
        return None
    return parse_limit(parameters["memory_limit"], source, "parameters.memory_limit")


def _queued_bytes(parameters: dict[str, str], source: str) -> int | None:
    if "max_queued_bytes" not in parameters:
        return None
    return parse_size(parameters["max_queued_bytes"], source, "parameters.max_queued_bytes")


_WARMUP_DATA = ("zero_data", "random_data", "input_data_file")


def _warmup(f: Fields) -> WarmupSample:
    f.check_keys({"name", "batch_size", "inputs", "count"})
    name = f.text("name")
    if not name:
        raise f.fail("name", "expected a non-empty warm-up sample name")
    inputs = f.sub("inputs")
    if inputs is None or not inputs.data:
        raise f.fail("inputs", "expected a mapping of input names to warm-up data")
    parsed = []
    for key, value in inputs.data.items():
        i = Fields(f.source, value, inputs.at(str(key)))
        i.check_keys({"data_type", "dims", *_WARMUP_DATA})
        raw_type = i.text("data_type")
        try:
            datatype = datatypes.from_config_type(raw_type)
        except ValueError:
            raise i.fail("data_type", f"expected a Triton data type, got {raw_type!r}") from None
        given = [k for k in _WARMUP_DATA if i.data.get(k) not in (None, False, "")]
        if len(given) != 1:
            raise ConfigError(
                f.source, i.path, f"expected exactly one of {', '.join(_WARMUP_DATA)}"
            )
        data = {"zero_data": "zero", "random_data": "random", "input_data_file": "file"}[given[0]]
        if data != "file" and i.data[given[0]] is not True:
            raise i.fail(given[0], f"expected true, got {i.data[given[0]]!r}")
        file = i.file_name("input_data_file") if data == "file" else ""
        parsed.append(WarmupInput(str(key), datatype, i.ints("dims", 0), data, file))
    return WarmupSample(
        name,
        # protobuf leaves 0 out; Triton treats a missing batch size and count as 1
        max(1, f.integer("batch_size", 1)),
        tuple(parsed),
        max(1, f.integer("count", 1)),
    )


def _check_against(
    cfg: TensorConfig, spec: TensorSpec, batched: bool, source: str, kind: str
) -> None:
    where = f"{kind} '{cfg.name}'"
    if cfg.datatype != spec.datatype:
        raise ConfigError(
            source, where, f"config says {cfg.datatype} but the model has {spec.datatype}"
        )
    model_dims = spec.shape[1:] if batched else spec.shape
    if batched and spec.shape and spec.shape[0] not in (-1,):
        raise ConfigError(
            source,
            where,
            "max_batch_size > 0 needs a dynamic first dim, but the model's shape is "
            f"{list(spec.shape)}",
        )
    dims = cfg.model_dims
    if len(model_dims) != len(dims) or any(
        m != -1 and c != -1 and m != c for m, c in zip(model_dims, dims, strict=True)
    ):
        full = ([-1] if batched else []) + list(dims)
        raise ConfigError(
            source, where, f"config dims {full} do not match the model's shape {list(spec.shape)}"
        )


def complete(
    config: ModelConfig,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    default_max_batch_size: int,
) -> ModelConfig:
    """Fill what the config left out from the engine's declared tensors, then check
    that what the config says agrees with the model (Triton's auto-complete)."""
    max_batch = config.max_batch_size
    if max_batch is None:
        batchable = all(len(s.shape) >= 1 and s.shape[0] == -1 for s in (*inputs, *outputs))
        ranks = {s.name: len(s.shape) for s in inputs}
        # declared dims with the model's full rank state the whole shape: that is a
        # config written for max_batch_size 0 (protobuf drops an explicit 0 from pbtxt)
        full_shape = bool(config.inputs) and all(
            len(t.dims) == ranks.get(t.name, -1) for t in config.inputs
        )
        max_batch = default_max_batch_size if batchable and not full_shape else 0
    batched = max_batch > 0
    dynamic = config.dynamic_batching
    if dynamic is None and config.max_batch_size is None and batched:
        dynamic = DynamicBatching()  # Triton enables dynamic batching when it picks a batch size

    # control and state tensors are fed and kept by the sequence batcher
    inputs = [s for s in inputs if s.name not in implicit_inputs(config.sequence_batching)]
    outputs = [s for s in outputs if s.name not in implicit_outputs(config.sequence_batching)]

    def fill(
        declared: tuple[TensorConfig, ...], specs: list[TensorSpec], kind: str
    ) -> tuple[TensorConfig, ...]:
        by_name = {s.name: s for s in specs}
        if not declared:
            # still checked below: an explicit max_batch_size > 0 needs dynamic first dims
            declared = tuple(
                TensorConfig(s.name, s.datatype, s.shape[1:] if batched else s.shape) for s in specs
            )
        for t in declared:
            if t.name not in by_name:
                raise ConfigError(
                    config.source,
                    f"{kind} '{t.name}'",
                    f"the model has no such {kind}; it has {sorted(by_name)}",
                )
            _check_against(t, by_name[t.name], batched, config.source, kind)
        return declared

    new_inputs = fill(config.inputs, inputs, "input")
    missing = {s.name for s in inputs} - {t.name for t in new_inputs}
    if missing:
        raise ConfigError(config.source, "input", f"the model also needs inputs {sorted(missing)}")
    return replace(
        config,
        max_batch_size=max_batch,
        inputs=new_inputs,
        outputs=fill(config.outputs, outputs, "output"),
        dynamic_batching=dynamic,
    )
