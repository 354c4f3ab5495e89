"""Triton's ``sequence_batching`` settings as typed values, and the tensors they imply.

The config parser (:mod:`appliance.config`) reads the field into a
:class:`SequenceBatching`; the sequence batcher (:mod:`appliance.sequence_batcher`)
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
