"""Model configuration: typed values, and the one validator every form goes through.

Model configs use Triton's field names: ``config.yaml``, or Triton's own
``config.pbtxt`` (protobuf text format, read with protobuf's parser against
Triton's published ``ModelConfig`` schema, then validated by the same code as
YAML). Every error names the file, the field and what was expected, e.g.
``models/simple/config.yaml: input[0].dims: expected a list of integers >= -1,
got ['x']`` for ``dims: [x]``. A config may leave inputs, outputs and max_batch_size out;
:func:`appliance.config.completion.complete` fills them from what the engine
declares, as Triton's auto-complete does.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from appliance import datatypes
from appliance.config.ensemble_config import EnsembleStep, parse_ensemble_steps
from appliance.config.fields import ConfigError, Fields, parse_limit, parse_size
from appliance.config.scheduling_config import (
    QueuePolicy,
    RateLimiterConfig,
    parse_priority_queue_policy,
    parse_queue_policy,
    parse_rate_limiter,
)
from appliance.config.sequence_config import (
    SequenceBatching,
    implicit_inputs,
    implicit_outputs,
    parse_sequence_batching,
)
from appliance.config.warmup_config import WarmupSample, parse_warmup

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
    timeout_action: str = "REJECT"  # or DELAY: a late request stays, served after the rest
    # Triton's priorities: levels 1 (first served) .. priority_levels; a request without
    # one (or with one out of range) gets default_priority_level; 0 levels: one queue
    priority_levels: int = 0
    default_priority_level: int = 0
    # levels with their own queue policy (the rest follow default_queue_policy)
    priority_queue_policy: tuple[tuple[int, QueuePolicy], ...] = ()

    @property
    def default_queue_policy(self) -> QueuePolicy:
        return QueuePolicy(
            self.max_queue_size,
            self.default_timeout_us,
            self.allow_timeout_override,
            self.timeout_action,
        )


@dataclass(frozen=True, slots=True)
class InstanceGroup:
    count: int = 1
    kind: str = "KIND_CPU"
    # what each instance holds while it runs (used when the server's rate_limit is on)
    rate_limiter: RateLimiterConfig | None = None


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
    # the server's max_queued_bytes_per_model; see appliance.core.queue_bytes)
    max_queued_bytes: int | None = None
    ensemble_steps: tuple[EnsembleStep, ...] = ()  # platform "ensemble" only
    sequence_batching: SequenceBatching | None = None  # stateful models
    decoupled: bool = False  # model_transaction_policy.decoupled: 0..N responses a request
    # response_cache.enable: answers kept by a key over the inputs (core/response_cache)
    response_cache: bool = False
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
    "response_cache",
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


def _response_cache(f: Fields) -> bool:
    cache = f.sub("response_cache")
    if cache is None:
        return False
    cache.check_keys({"enable"})
    return cache.flag("enable", False)


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
    if "preserve_ordering" in f.data:
        log.warning("%s: %s: 'preserve_ordering' is not supported and is ignored", f.source, f.path)
    policy = f.sub("default_queue_policy")
    default = parse_queue_policy(policy) if policy is not None else QueuePolicy()
    levels = f.integer("priority_levels", 0, minimum=0)
    default_level = f.integer("default_priority_level", 0, minimum=0)
    if levels and not 1 <= default_level <= levels:
        raise f.fail(
            "default_priority_level",
            f"expected a level in 1..{levels} (priority_levels), got {default_level}",
        )
    by_level = f.sub("priority_queue_policy")
    return DynamicBatching(
        preferred_batch_size=f.ints("preferred_batch_size", 1),
        max_queue_delay_us=f.integer("max_queue_delay_microseconds", 0),
        max_queue_size=default.max_queue_size,
        default_timeout_us=default.default_timeout_us,
        allow_timeout_override=default.allow_timeout_override,
        timeout_action=default.timeout_action,
        priority_levels=levels,
        default_priority_level=default_level if levels else 0,
        priority_queue_policy=(
            parse_priority_queue_policy(by_level, levels) if by_level is not None else ()
        ),
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
        for key in ("secondary_devices", "host_policy", "profile", "passive"):
            if key in g.data:
                log.warning("%s: %s: '%s' is not supported and is ignored", source, g.path, key)
        kind = g.text("kind", "KIND_CPU")
        if kind not in ("KIND_CPU", "KIND_GPU", "KIND_AUTO", "KIND_MODEL"):
            raise g.fail(
                "kind", f"expected KIND_CPU, KIND_GPU, KIND_AUTO or KIND_MODEL, got {kind!r}"
            )
        limiter = g.sub("rate_limiter")
        groups.append(
            InstanceGroup(
                g.integer("count", 1, minimum=1),
                kind,
                parse_rate_limiter(limiter) if limiter is not None else None,
            )
        )
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
    warmup = tuple(parse_warmup(w) for w in f.entries("model_warmup"))
    for i, w in enumerate(warmup):
        if max_batch is not None and w.batch_size > max(1, max_batch):
            raise f.fail(
                f"model_warmup[{i}].batch_size",
                f"{w.batch_size} exceeds max_batch_size {max_batch}"
                + ("" if max_batch else " (a model that does not batch warms up one sample)"),
            )
    steps = parse_ensemble_steps(f)
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
        parse_sequence_batching(seq)
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
        response_cache=_response_cache(f),
        source=source,
    )


def _memory_limit(parameters: dict[str, str], source: str) -> int | None:
    if "memory_limit" not in parameters:
        return None
    return parse_limit(parameters["memory_limit"], source, "parameters.memory_limit")


def _queued_bytes(parameters: dict[str, str], source: str) -> int | None:
    if "max_queued_bytes" not in parameters:
        return None
    return parse_size(parameters["max_queued_bytes"], source, "parameters.max_queued_bytes")
