"""Triton's identity backend: each ``OUTPUT<i>`` is a copy of ``INPUT<i>``.

Triton's QA suite builds models of this backend (``backend: "identity"``) as ensemble
steps and for optional inputs (its ``nop_*`` and ``identity_*`` models); with it,
those repositories load here as they are. As Triton's:

- the config pairs ``INPUT<i>`` with ``OUTPUT<i>``, same datatype and dims (refused
  at load with Triton's texts otherwise); there is no model file;
- an optional input left out of a request, whose output is asked for, answers
  zeros of its config's dims (-1 as 1), after the batch dim of the request's other
  inputs where the model batches;
- ``parameters``: ``execute_delay_ms`` (each execution sleeps that long; with
  ``instance_wise_delay_multiplier`` > 0 the delay is multiplied by that times the
  instance's index), ``creation_delay_sec`` (each instance's creation sleeps that
  long: both for tests of timing and of loading).

An output is its input array itself (nothing writes to either: no copy), so a run is
cheap and runs on the event loop like ONNX Runtime's (``inline_safe``) unless the
config asks for a delay.
"""

from __future__ import annotations

import time

import numpy as np

from appliance import datatypes
from appliance.backends.base import BackendOptions, TensorSpec
from appliance.errors import invalid


def _index(name: str, prefix: str) -> str:
    if not name.startswith(prefix):
        what = "input" if prefix == "INPUT" else "output"
        raise invalid(f"expected {what} name to follow {prefix}<index> pattern, got '{name}'")
    return name[len(prefix) :]


def _number(parameters: dict[str, str], key: str, model: str) -> int:
    raw = parameters.get(key, "0") or "0"
    try:
        value = int(raw)
    except ValueError:
        raise invalid(f"model '{model}': parameter {key} must be an integer, got {raw!r}") from None
    if value < 0:
        raise invalid(f"model '{model}': parameter {key} must not be negative, got {value}")
    return value


class IdentityBackend:
    def __init__(self, options: BackendOptions) -> None:
        model = options.model_name
        if not options.inputs:
            raise invalid(
                f"model '{model}': the identity backend needs a config that declares its "
                "INPUT<i>/OUTPUT<i> pairs"
            )
        if len(options.inputs) != len(options.outputs):
            raise invalid("model configuration must have equal input/output pairs")
        by_index = {_index(t.name, "INPUT"): t for t in options.inputs}
        self._pairs: list[tuple[TensorSpec, TensorSpec]] = []
        for out in options.outputs:
            spec = by_index.get(_index(out.name, "OUTPUT"))
            if spec is None:
                raise invalid("expected input and output indices to match")
            if spec.datatype != out.datatype:
                raise invalid(
                    "expected input and output datatype to match, got "
                    f"{spec.datatype} and {out.datatype}"
                )
            if spec.shape != out.shape:
                raise invalid(
                    f"expected input and output shape to match, got {list(spec.shape)} "
                    f"and {list(out.shape)}"
                )
            self._pairs.append((spec, out))
        self.inputs = list(options.inputs)
        self.outputs = list(options.outputs)
        self._batched = bool(options.max_batch_size)
        params = options.parameters
        delay_ms = _number(params, "execute_delay_ms", model)
        multiplier = _number(params, "instance_wise_delay_multiplier", model)
        if multiplier:
            delay_ms *= max(multiplier * options.instance_index, 1)
        self._delay_s = delay_ms / 1000
        self.inline_safe = self._delay_s == 0  # a copy: nothing thread-bound
        time.sleep(_number(params, "creation_delay_sec", model))

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        if self._delay_s:
            time.sleep(self._delay_s)
        wanted = set(outputs)
        batch = next((a.shape[0] for a in inputs.values() if a.ndim), 1) if self._batched else 0
        out: dict[str, np.ndarray] = {}
        for spec, target in self._pairs:
            if target.name not in wanted:
                continue
            given = inputs.get(spec.name)
            if given is not None:
                out[target.name] = given  # (never written to: no copy needed)
                continue
            # an optional input left out: zeros of its declared dims (-1 as 1)
            declared = spec.shape[1:] if self._batched else spec.shape
            dims = [1 if d < 0 else d for d in declared]
            shape = (batch, *dims) if self._batched else tuple(dims)
            dtype = datatypes.to_numpy_dtype(spec.datatype)
            if dtype == np.dtype(object):
                out[target.name] = np.full(shape, b"", dtype=object)
            else:
                out[target.name] = np.zeros(shape, dtype=dtype)
        return out

    def close(self) -> None:
        self._pairs = []
