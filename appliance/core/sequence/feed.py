"""What the sequence batcher adds to each request: control inputs and implicit state.

Control tensors follow Triton: START, END and READY carry the configured false or
true value (INT32, FP32 or BOOL), CORRID the correlation id (an integer type, or
BYTES for string ids); each is one element per batch row (shape ``[1, 1]`` for a
batching model, ``[1]`` otherwise). A state input is fed the sequence's previous
state output; at START it is the configured initial state (zeros, or the bytes of
``initial_state/<data_file>`` in the model folder, read once at load).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from appliance import datatypes
from appliance.config.fields import ConfigError
from appliance.config.model_config import ModelConfig
from appliance.config.sequence_config import CORRID, END, READY, START, ImplicitState
from appliance.errors import invalid
from appliance.request import InferenceRequest

# the folder Triton reads initial_state data files from
INITIAL_STATE_DIR = "initial_state"


class Feed:
    """Builds the engine inputs of one model's sequence requests."""

    def __init__(self, config: ModelConfig) -> None:
        sb = config.sequence_batching
        assert sb is not None
        self.model = config.name
        self._batched = config.batch_size > 0
        self._lead = (1,) if self._batched else ()
        self._controls = sb.controls
        self._corrid = sb.control(CORRID)
        self._states = sb.states
        self.state_outputs = [s.output_name for s in sb.states]
        # the constant control tensors, built once: (kind, flag) -> array
        self._flags: dict[tuple[str, bool], np.ndarray] = {}
        for c in sb.controls:
            if c.kind == CORRID:
                continue
            dtype = datatypes.to_numpy_dtype(c.datatype)
            for flag in (False, True):
                arr = np.full((*self._lead, 1), c.value(flag), dtype=dtype)
                arr.flags.writeable = False
                self._flags[(c.kind, flag)] = arr

    def check_id(self, key: int | str) -> None:
        """A string id cannot travel in an integer CORRID control (nor the reverse
        be mistaken): refused before it is queued."""
        if self._corrid is None or self._corrid.datatype == "BYTES":
            return
        if isinstance(key, str):
            raise invalid(
                f"model '{self.model}' takes integer correlation IDs "
                f"(its CORRID control is {self._corrid.datatype}), got the string {key!r}"
            )
        info = np.iinfo(datatypes.to_numpy_dtype(self._corrid.datatype))
        if not info.min <= key <= info.max:
            raise invalid(
                f"correlation ID {key} does not fit model '{self.model}''s CORRID control "
                f"({self._corrid.datatype})"
            )

    def _controls_for(
        self, start: bool, end: bool, ready: bool, key: int | str
    ) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for c in self._controls:
            if c.kind == CORRID:
                if c.datatype == "BYTES":
                    arr = np.empty((*self._lead, 1), dtype=object)
                    arr.fill(str(key).encode() if ready else b"")
                else:
                    arr = np.full((*self._lead, 1), key, datatypes.to_numpy_dtype(c.datatype))
                out[c.name] = arr
            else:
                flag = {START: start, END: end, READY: ready}[c.kind]
                out[c.name] = self._flags[(c.kind, flag)]
        return out

    def initial_state(self) -> dict[str, np.ndarray]:
        """A sequence's state at START, as fed (with the batch dim where the model batches)."""
        return {s.input_name: _lead(s.start_value(), self._batched) for s in self._states}

    def inputs(
        self, request: InferenceRequest, state: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The request's own inputs plus its controls (READY true) and state."""
        feed = dict(request.inputs)
        feed.update(
            self._controls_for(
                request.sequence_start, request.sequence_end, True, request.sequence_id
            )
        )
        feed.update(state)
        return feed

    def filler(
        self, like: dict[str, np.ndarray], state: dict[str, np.ndarray] | None
    ) -> dict[str, np.ndarray]:
        """A direct-strategy row for a slot with nothing ready: another row's inputs
        (so shapes agree), every control false, CORRID 0, state zeros."""
        feed = dict(like)
        feed.update(self._controls_for(False, False, False, 0))
        for name, arr in (state or self.initial_state()).items():
            feed[name] = np.zeros_like(arr)
        return feed

    def next_state(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The state to feed next, from one row's outputs."""
        return {s.input_name: outputs[s.output_name] for s in self._states}


def _lead(arr: np.ndarray, batched: bool) -> np.ndarray:
    return arr[np.newaxis] if batched else arr


def load_initial_states(config: ModelConfig, model_dir: Path) -> ModelConfig:
    """``config`` with each ``data_file`` initial state read from the model's
    ``initial_state/`` folder (confined to it); ConfigError names what is wrong."""
    sb = config.sequence_batching
    if sb is None or not any(s.initial_file for s in sb.states):
        return config
    folder = (model_dir / INITIAL_STATE_DIR).resolve()
    states: list[ImplicitState] = []
    for i, s in enumerate(sb.states):
        if not s.initial_file:
            states.append(s)
            continue
        where = f"sequence_batching.state[{i}].initial_state.data_file"
        path = (folder / s.initial_file).resolve()
        if not path.is_relative_to(folder) or not path.is_file():
            raise ConfigError(
                config.source, where, f"no file {s.initial_file!r} in {INITIAL_STATE_DIR}/"
            )
        dims = s.initial_dims or ()
        dtype = datatypes.to_numpy_dtype(s.datatype)
        if s.datatype == "BYTES":
            raise ConfigError(config.source, where, "string initial states are not supported")
        count = datatypes.element_count(list(dims))
        raw = path.read_bytes()
        if len(raw) < count * dtype.itemsize:
            raise ConfigError(
                config.source,
                where,
                f"initial_state setting expects {count * dtype.itemsize} bytes, but the "
                f"data provided from {s.initial_file} only has {len(raw)} bytes",
            )
        value = np.frombuffer(raw, dtype=dtype, count=count).reshape(dims)
        states.append(replace(s, initial=value))
    return replace(config, sequence_batching=replace(sb, states=tuple(states)))


def warmup_inputs(config: ModelConfig, rows: int) -> dict[str, np.ndarray]:
    """Zero controls and initial states for ``rows`` batch rows: what a warm-up
    sample of a sequence model adds to its declared inputs."""
    sb = config.sequence_batching
    if sb is None:
        return {}
    batched = config.batch_size > 0
    lead = (rows,) if batched else ()
    out: dict[str, np.ndarray] = {}
    for c in sb.controls:
        if c.datatype == "BYTES":
            arr = np.empty((*lead, 1), dtype=object)
            arr.fill(b"")
        else:
            arr = np.zeros((*lead, 1), dtype=datatypes.to_numpy_dtype(c.datatype))
        out[c.name] = arr
    for s in sb.states:
        value = s.start_value()
        out[s.input_name] = np.broadcast_to(value, lead + value.shape).copy() if batched else value
    return out
