"""Triton's ``reshape`` of model inputs and outputs.

A tensor's ``dims`` are what clients send and receive; its ``reshape`` is what the
engine sees (e.g. dims ``[1, 28, 28]`` for a model input of ``[28, 28]``). Inputs
are reshaped after the request is validated against ``dims``, outputs before the
response leaves the model version; the batch dimension (when the model batches)
stays in front. Reshaping a contiguous array is a view, so nothing is copied.
"""

from __future__ import annotations

import numpy as np

from appliance.config.model_config import ModelConfig, TensorConfig
from appliance.decoupled import RequestInputs


def _apply(
    arrays: dict[str, np.ndarray], specs: tuple[TensorConfig, ...], batched: bool, to_model: bool
) -> dict[str, np.ndarray]:
    out = dict(arrays)
    for spec in specs:
        arr = arrays.get(spec.name)
        if spec.reshape is None or arr is None:
            continue
        lead = list(arr.shape[:1]) if batched else []
        target = spec.reshape if to_model else spec.dims
        out[spec.name] = arr.reshape(lead + [d if d >= 0 else -1 for d in target])
    return out


def inputs_for_model(config: ModelConfig, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The request's inputs in the shapes the engine expects (the same dict object
    when no input is reshaped: a decoupled request's stream travels with it)."""
    if all(t.reshape is None for t in config.inputs):
        return inputs
    reshaped = _apply(inputs, config.inputs, config.batch_size > 0, True)
    if isinstance(inputs, RequestInputs):
        return RequestInputs(reshaped, inputs.stream, inputs.parameters, inputs.cancel)
    return reshaped


def outputs_for_client(
    config: ModelConfig, outputs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The engine's outputs in the shapes the config's ``dims`` promise clients (a
    decoupled model's responses are reshaped as they stream, not here)."""
    if config.decoupled or all(t.reshape is None for t in config.outputs):
        return outputs
    return _apply(outputs, config.outputs, config.batch_size > 0, False)
