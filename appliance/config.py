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

import difflib
import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from appliance import datatypes
from appliance.errors import ApplianceError, Code
from backends.base import TensorSpec

log = logging.getLogger(__name__)


class ConfigError(ApplianceError):
    """A config file is invalid; the message names file, field and expectation."""

    def __init__(self, source: str, path: str, message: str) -> None:
        where = f"{source}: {path}: " if path else f"{source}: "
        super().__init__(Code.INVALID_ARG, where + message)


@dataclass(frozen=True, slots=True)
class TensorConfig:
    name: str
    datatype: str  # KServe name
    dims: tuple[int, ...]  # without the batch dim; -1 = any size
    optional: bool = False


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
    ensemble_steps: tuple[EnsembleStep, ...] = ()  # platform "ensemble" only
    source: str = "<auto-complete>"

    @property
    def batch_size(self) -> int:
        return self.max_batch_size or 0

    @property
    def instance_count(self) -> int:
        return sum(g.count for g in self.instance_group)


# Triton fields accepted but not acted on yet: warned about, never silently dropped.
_UNSUPPORTED = {
    "sequence_batching",
    "optimization",
    "response_cache",
    "model_transaction_policy",
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
} | _UNSUPPORTED


_INT = re.compile(r"-?\d+")


class Fields:
    """Typed reads of one mapping, with errors naming the file and field path."""

    def __init__(self, source: str, data: Any, path: str = "") -> None:
        if not isinstance(data, dict):
            raise ConfigError(source, path, f"expected a mapping, got {type(data).__name__}")
        self.source, self.data, self.path = source, data, path

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(self.source, self.at(key), message)

    def check_keys(self, allowed: set[str]) -> None:
        for key in self.data:
            if key not in allowed:
                near = difflib.get_close_matches(str(key), sorted(allowed), n=1)
                hint = f"did you mean {near[0]}? " if near else ""
                raise self.fail(
                    str(key), f"unknown field, {hint}expected one of {sorted(allowed)}"
                )

    def integer(self, key: str, default: int, minimum: int = 0) -> int:
        value = self.data.get(key, default)
        if isinstance(value, str) and _INT.fullmatch(value):
            value = int(value)  # protobuf JSON writes int64 as strings
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.fail(key, f"expected an integer >= {minimum}, got {value!r}")
        return value

    def text(self, key: str, default: str = "") -> str:
        value = self.data.get(key, default)
        if not isinstance(value, str):
            raise self.fail(key, f"expected a string, got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {value!r}")
        return value

    def ints(self, key: str, minimum: int) -> tuple[int, ...]:
        value = self.data.get(key, [])
        if isinstance(value, list):  # protobuf JSON writes int64 as strings
            value = [int(v) if isinstance(v, str) and _INT.fullmatch(v) else v for v in value]
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value
        ):
            raise self.fail(key, f"expected a list of integers >= {minimum}, got {value!r}")
        return tuple(value)

    def entries(self, key: str) -> list[Fields]:
        value = self.data.get(key, [])
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list, got {type(value).__name__}")
        return [Fields(self.source, v, f"{self.at(key)}[{i}]") for i, v in enumerate(value)]

    def sub(self, key: str) -> Fields | None:
        if key not in self.data or self.data[key] is None:
            return None
        return Fields(self.source, self.data[key], self.at(key))


# Triton tensor fields accepted but not acted on yet (warned about, like model fields).
_UNSUPPORTED_TENSOR = (
    "reshape",
    "label_filename",
    "is_shape_tensor",
    "allow_ragged_batch",
    "is_non_linear_format_io",
)


def _tensor(f: Fields) -> TensorConfig:
    f.check_keys({"name", "data_type", "dims", "optional", "format", *_UNSUPPORTED_TENSOR})
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
    return TensorConfig(name, datatype, f.ints("dims", -1), f.flag("optional", False))


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
    if steps and not (max_batch is not None and f.data.get("input") and f.data.get("output")):
        raise f.fail(
            "ensemble_scheduling",
            "an ensemble has no engine to complete its config from: "
            "declare max_batch_size, input and output",
        )
    return ModelConfig(
        name=name,
        backend=f.text("backend"),
        platform=f.text("platform"),
        max_batch_size=max_batch,
        inputs=tuple(_tensor(t) for t in f.entries("input")),
        outputs=tuple(_tensor(t) for t in f.entries("output")),
        dynamic_batching=dynamic,
        instance_group=tuple(groups) or (InstanceGroup(),),
        version_policy=_version_policy(vp) if vp is not None else VersionPolicy(),
        default_model_filename=f.text("default_model_filename"),
        parameters=parameters,
        model_warmup=warmup,
        memory_limit=_memory_limit(parameters, source),
        ensemble_steps=steps,
        source=source,
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
        model = s.text("model_name")
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
    from appliance.memory import parse_limit  # here: memory imports this module

    return parse_limit(parameters["memory_limit"], source, "parameters.memory_limit")


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
        file = i.text("input_data_file") if data == "file" else ""
        parsed.append(WarmupInput(str(key), datatype, i.ints("dims", 0), data, file))
    return WarmupSample(
        name,
        # protobuf leaves 0 out; Triton treats a missing batch size and count as 1
        max(1, f.integer("batch_size", 1)),
        tuple(parsed),
        max(1, f.integer("count", 1)),
    )


CONFIG_FILES = ("config.yaml", "config.yml", "config.pbtxt")


def load_model_config(model_dir: Path) -> ModelConfig:
    """Read ``model_dir/config.yaml`` (or .yml) or Triton's ``config.pbtxt``; no file
    means everything is auto-completed. Two config files are an error: which one
    counts would be a guess."""
    found = [model_dir / n for n in CONFIG_FILES if (model_dir / n).is_file()]
    if len(found) > 1:
        raise ConfigError(
            str(model_dir),
            "",
            f"found {' and '.join(p.name for p in found)}: keep exactly one config file",
        )
    if not found:
        return ModelConfig(name=model_dir.name, source=str(model_dir))
    path = found[0]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), "", f"not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc.strerror}") from None
    if path.suffix == ".pbtxt":
        from appliance.triton_config import pbtxt_to_dict  # protobuf: only when needed

        data = pbtxt_to_dict(text, str(path))
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(str(path), "", f"not valid YAML: {exc}") from None
    return parse_model_config(data, model_dir.name, str(path))


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
    if len(model_dims) != len(cfg.dims) or any(
        m != -1 and c != -1 and m != c for m, c in zip(model_dims, cfg.dims, strict=True)
    ):
        full = ([-1] if batched else []) + list(cfg.dims)
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
