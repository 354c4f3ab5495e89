"""ONNX Runtime backend (CPU execution provider).

Each instance owns one ``InferenceSession`` whose intra-op pool is sized to the
instance's share of the cores (``BackendOptions.threads``), so N instances on a
small device don't oversubscribe it. Spinning is off: a spinning pool burns the
core another instance (or the event loop) needs.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from appliance.errors import invalid
from backends.base import BackendOptions, TensorSpec

# ONNX Runtime's type strings -> KServe datatypes
_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def _spec(arg: ort.NodeArg, model: str) -> TensorSpec:
    datatype = _TYPES.get(arg.type)
    if datatype is None:
        raise invalid(f"model '{model}': tensor '{arg.name}' has unsupported type {arg.type}")
    # symbolic or unknown dims ('batch', None) are dynamic
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or []))
    return TensorSpec(arg.name, datatype, shape)


def _to_ort_strings(arr: np.ndarray, name: str) -> np.ndarray:
    """ONNX Runtime takes str objects for string tensors (bytes would be str()-ed)."""
    out = np.empty(arr.shape, dtype=object)
    try:
        out.ravel()[:] = [x.decode("utf-8") if isinstance(x, bytes) else x for x in arr.ravel()]
    except UnicodeDecodeError:
        raise invalid(f"input '{name}': ONNX Runtime string tensors must be UTF-8") from None
    return out


class OnnxRuntimeBackend:
    """One ONNX Runtime session = one model instance."""

    def __init__(self, options: BackendOptions) -> None:
        so = ort.SessionOptions()
        so.intra_op_num_threads = max(1, options.threads)
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # never spin: a spinning pool burns the cores the event loop (HTTP decoding) and
        # the other instances need; on a 2-8 core device that costs more than it saves
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        level = options.parameters.get("graph_optimization_level", "ORT_ENABLE_ALL")
        so.graph_optimization_level = getattr(
            ort.GraphOptimizationLevel, level, ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        )
        self._session = ort.InferenceSession(
            str(options.model_path), sess_options=so, providers=["CPUExecutionProvider"]
        )
        model = options.model_path.parent.parent.name
        self.inputs = [_spec(a, model) for a in self._session.get_inputs()]
        self.outputs = [_spec(a, model) for a in self._session.get_outputs()]
        self._string_inputs = {s.name for s in self.inputs if s.datatype == "BYTES"}

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        feed = inputs
        if self._string_inputs:
            feed = {
                k: _to_ort_strings(v, k) if k in self._string_inputs else v
                for k, v in inputs.items()
            }
        results = self._session.run(outputs, feed)
        return dict(zip(outputs, results, strict=True))

    def close(self) -> None:
        # dropping the last reference frees the session's arena and weights
        del self._session
