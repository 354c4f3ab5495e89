"""Triton's ``sequence_batching`` settings as typed values, and the tensors they imply.

:func:`parse_sequence_batching` reads the field (for :mod:`appliance.config.model_config`) into a
:class:`SequenceBatching`; the sequence batcher (:mod:`appliance.core.sequence.batcher`)
acts on it. Control inputs and implicit-state tensors are fed by the server, not
sent by clients, so they are not among a model's declared ``input``/``output``;
:func:`implicit_inputs` and :func:`implicit_outputs` name them for the loader and
auto-complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance import datatypes
from appliance.config.fields import ConfigError, Fields

START = "CONTROL_SEQUENCE_START"
END = "CONTROL_SEQUENCE_END"
READY = "CONTROL_SEQUENCE_READY"
CORRID = "CONTROL_SEQUENCE_CORRID"
KINDS = (START, END, READY, CORRID)
# CORRID's data types (Triton's); the boolean kinds are INT32, FP32 or BOOL
CORRID_TYPES = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")


@dataclass(frozen=True, slots=True)
class Control:
    """One control input: the tensor ``name`` carries ``kind``. Boolean kinds send
    ``false_true[0]`` or ``false_true[1]`` as ``datatype``; CORRID sends the id."""

    name: str
    kind: str
    datatype: str
    false_true: tuple[Any, Any] = (0, 1)

    def value(self, flag: bool) -> Any:
        return self.false_true[1] if flag else self.false_true[0]


@dataclass(frozen=True, slots=True)
class ImplicitState:
    """A state input/output pair the server carries from one request of a sequence
    to the next. ``initial_dims`` is None without ``initial_state``; with it the
    state at START is zeros of those dims (``zero_data``) or the raw bytes of
    ``initial_file`` (in the model's ``initial_state/`` folder), read at load into
    ``initial``. Without it the state starts as zeros of ``dims`` (variable dims 0).
    """

    input_name: str
    output_name: str
    datatype: str
    dims: tuple[int, ...]
    initial_dims: tuple[int, ...] | None = None
    initial_name: str = ""
    initial_file: str = ""
    initial: np.ndarray | None = field(default=None, compare=False)

    def start_value(self) -> np.ndarray:
        """The state at START: one sequence's value, without a batch dim."""
        if self.initial is not None:
            return self.initial
        dims = self.initial_dims if self.initial_dims is not None else self.dims
        shape = tuple(max(d, 0) for d in dims)
        return np.zeros(shape, dtype=datatypes.to_numpy_dtype(self.datatype))


@dataclass(frozen=True, slots=True)
class SequenceBatching:
    """``strategy``: "direct" or "oldest". ``max_candidate_sequences`` (oldest) and
    the delay/preferred sizes configure how many sequences one instance batches."""

    strategy: str = "direct"
    max_sequence_idle_us: int = 1_000_000  # Triton's default: one second
    controls: tuple[Control, ...] = ()
    states: tuple[ImplicitState, ...] = ()
    max_candidate_sequences: int = 0
    preferred_batch_size: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    minimum_slot_utilization: float = 0.0

    def control(self, kind: str) -> Control | None:
        return next((c for c in self.controls if c.kind == kind), None)

    def json(self) -> dict[str, Any]:
        """Triton's JSON form (the config endpoint)."""

        def control(c: Control) -> dict[str, Any]:
            doc: dict[str, Any] = {"kind": c.kind}
            if c.kind == CORRID:
                doc["data_type"] = datatypes.to_config_type(c.datatype)
            else:
                key = {"INT32": "int32_false_true", "FP32": "fp32_false_true"}.get(
                    c.datatype, "bool_false_true"
                )
                doc[key] = list(c.false_true)
            return {"name": c.name, "control": [doc]}

        def state(s: ImplicitState) -> dict[str, Any]:
            doc: dict[str, Any] = {
                "input_name": s.input_name,
                "output_name": s.output_name,
                "data_type": datatypes.to_config_type(s.datatype),
                "dims": list(s.dims),
            }
            if s.initial_dims is not None:
                init: dict[str, Any] = {
                    "name": s.initial_name,
                    "data_type": doc["data_type"],
                    "dims": list(s.initial_dims),
                }
                if s.initial_file:
                    init["data_file"] = s.initial_file
                else:
                    init["zero_data"] = True
                doc["initial_state"] = [init]
            return doc

        out: dict[str, Any] = {
            "max_sequence_idle_microseconds": self.max_sequence_idle_us,
            "control_input": [control(c) for c in self.controls],
            "state": [state(s) for s in self.states],
        }
        if self.strategy == "oldest":
            out["oldest"] = {
                "max_candidate_sequences": self.max_candidate_sequences,
                "preferred_batch_size": list(self.preferred_batch_size),
                "max_queue_delay_microseconds": self.max_queue_delay_us,
            }
        else:
            out["direct"] = {
                "max_queue_delay_microseconds": self.max_queue_delay_us,
                "minimum_slot_utilization": self.minimum_slot_utilization,
            }
        return out


def implicit_inputs(sb: SequenceBatching | None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Inputs the server feeds: name -> (datatype, dims without the batch dim)."""
    if sb is None:
        return {}
    out: dict[str, tuple[str, tuple[int, ...]]] = {c.name: (c.datatype, (1,)) for c in sb.controls}
    out.update({s.input_name: (s.datatype, s.dims) for s in sb.states})
    return out


def implicit_outputs(sb: SequenceBatching | None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Outputs the server keeps (state outputs): name -> (datatype, dims)."""
    if sb is None:
        return {}
    return {s.output_name: (s.datatype, s.dims) for s in sb.states}


# ---- reading the config field ------------------------------------------------------


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


def parse_sequence_batching(f: Fields) -> SequenceBatching:
    """Triton's ``sequence_batching`` mapping, validated; errors name file and field."""
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
