"""ONNX Runtime backend: the CPU execution provider, or CUDA / TensorRT on a GPU.

The instances of one loaded copy share one ``InferenceSession`` (its ``run`` is
thread-safe): the first instance builds it, the others each run it from their own
thread, so weights are held once and each further instance costs only its working
memory. The session is keyed by ``BackendOptions.share_group`` and freed with the
last instance; ``parameters: {share_session: false}`` gives each instance its own.
A shared session's intra-op pool has every usable core
(``BackendOptions.shared_threads``): the instances' runs draw on that one pool, so a
lone busy instance runs at full speed and N busy ones share the cores instead of each
being held to a 1/N slice; a session of its own (``share_session: false``, or each
instance in its own process) gets the instance's share (``BackendOptions.threads``), so
N instances don't oversubscribe the device. Spinning is off: a spinning pool burns the
core another instance (or the event loop) needs.

Execution providers follow the instance group's kind (:func:`select_providers`):
KIND_CPU runs on the CPU; KIND_GPU on CUDA, or on TensorRT with
``parameters: {execution_provider: tensorrt}``; KIND_AUTO on the GPU when this
ONNX Runtime build has one, else on the CPU. The GPU providers ship in the
``onnxruntime-gpu`` wheel (NVIDIA's JetPack wheel on Jetson), which replaces
``onnxruntime``; ONNX Runtime loads them only when a session asks for them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from appliance.backends import model_check, sealed
from appliance.backends.base import BackendOptions, TensorSpec, check_inputs
from appliance.backends.parameters import Parameters
from appliance.backends.shared import Lease, SharedCache, file_identity
from appliance.datatypes import to_numpy_dtype
from appliance.errors import invalid

log = logging.getLogger(__name__)

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
ProviderList = list[tuple[str, dict[str, str]]]

# sessions shared by the instances of one loaded copy; freed with the last lease
_SESSIONS: SharedCache[ort.InferenceSession] = SharedCache(lambda session: None)

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


def select_providers(
    kind: str,
    parameters: Mapping[str, str],
    available: Sequence[str],
    model: str,
    cache_dir: Path,
) -> ProviderList:
    """ONNX Runtime providers (with options), best first, for an instance of ``kind``.

    ``parameters``: ``execution_provider`` (cpu | cuda | tensorrt), ``device_id``
    (default 0), ``precision`` (FP32 | FP16; FP16 only with tensorrt). TensorRT
    engines are cached in ``cache_dir`` (next to the model): building one takes
    minutes and an engine only runs on the GPU and TensorRT version that built it,
    which ONNX Runtime checks. Raises INVALID_ARG for a contradiction or, on
    KIND_GPU, a provider this ONNX Runtime build lacks.
    """
    p = Parameters(model, parameters)
    wanted = p.choice(("execution_provider",), PROVIDERS, "cpu" if kind == "KIND_CPU" else "cuda")
    device = p.integer(("device_id",), 0)
    precision = p.choice(("precision",), ("FP32", "FP16"), "FP32")
    if kind == "KIND_CPU" and wanted != "cpu":
        raise invalid(
            f"model '{model}': execution_provider {wanted} runs on a GPU, but the instance "
            "group's kind is KIND_CPU; set kind: KIND_GPU (or KIND_AUTO)"
        )
    if kind == "KIND_GPU" and wanted == "cpu":
        raise invalid(
            f"model '{model}': execution_provider cpu contradicts the instance group's "
            "kind KIND_GPU; set kind: KIND_CPU"
        )
    if precision == "FP16" and wanted != "tensorrt":
        raise invalid(
            f"model '{model}': precision FP16 needs execution_provider: tensorrt "
            "(the CPU and CUDA providers run the model's own types)"
        )
    needed = [PROVIDERS[wanted]] + (["CUDAExecutionProvider"] if wanted == "tensorrt" else [])
    missing = [n for n in needed if n not in available]
    if missing and kind == "KIND_AUTO":
        log.warning("model '%s': no %s in this ONNX Runtime, running on the CPU", model, missing)
        wanted = "cpu"
    elif missing:
        raise invalid(
            f"model '{model}': {missing[0]} is not in this ONNX Runtime build (it has "
            f"{list(available)}); install onnxruntime-gpu in place of onnxruntime (on "
            "Jetson: the JetPack wheel) on a machine with an NVIDIA GPU"
        )
    cuda = {"device_id": str(device), "arena_extend_strategy": "kSameAsRequested"}
    providers: ProviderList = []
    if wanted == "tensorrt":
        providers.append(
            (
                PROVIDERS["tensorrt"],
                {
                    "device_id": str(device),
                    "trt_fp16_enable": str(precision == "FP16"),
                    "trt_engine_cache_enable": "True",
                    "trt_engine_cache_path": str(cache_dir),
                    "trt_timing_cache_enable": "True",
                    "trt_timing_cache_path": str(cache_dir),
                },
            )
        )
    if wanted in ("tensorrt", "cuda"):
        providers.append((PROVIDERS["cuda"], cuda))
    providers.append((PROVIDERS["cpu"], {}))
    return providers


def _without_engine_cache(providers: ProviderList) -> ProviderList:
    """TensorRT's engine cache would write the model, compiled, to disk: off for a
    sealed model (whose engine is then built at each load)."""
    trt = PROVIDERS["tensorrt"]
    return [(n, {**o, "trt_engine_cache_enable": "False"} if n == trt else o) for n, o in providers]


class OnnxRuntimeBackend:
    """One model instance: its own thread's handle on a (shared) ONNX Runtime session."""

    def __init__(self, options: BackendOptions) -> None:
        model = options.model_name
        share = Parameters(model, options.parameters).flag(("share_session",), True)
        shared = share and bool(options.share_group)
        self.threads = max(
            1, (options.shared_threads or options.threads) if shared else options.threads
        )
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # never spin: a spinning pool burns the cores the event loop (HTTP decoding) and
        # the other instances need; on a 2-8 core device that costs more than it saves
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        level = options.parameters.get("graph_optimization_level", "ORT_ENABLE_ALL")
        so.graph_optimization_level = getattr(
            ort.GraphOptimizationLevel, level, ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        )
        providers = select_providers(
            options.kind,
            options.parameters,
            ort.get_available_providers(),
            model,
            options.model_path.parent / "ort_trt_cache",
        )
        if len(providers) > 1:
            log.info("model '%s': ONNX Runtime providers %s", model, [n for n, _ in providers])

        def build() -> ort.InferenceSession:
            # a sealed file opens into memory; TensorRT's engine cache would put the
            # model on disk, so a sealed model's engine is built each time instead
            data = sealed.read_model(options.model_path, options.key_file)
            chosen = providers if data is None else _without_engine_cache(providers)
            try:
                return ort.InferenceSession(
                    data if data is not None else str(options.model_path),
                    sess_options=so,
                    providers=[name for name, _ in chosen],
                    provider_options=[opts for _, opts in chosen],
                )
            except Exception as exc:  # a model newer than this runtime: say what to do
                hint = model_check.explain(str(exc), ort.__version__)
                if hint is None:
                    raise
                raise invalid(f"model '{model}': {hint}") from None

        self._lease: Lease[ort.InferenceSession] | None = None
        if shared:
            key = (options.share_group, file_identity(options.model_path))
            self._lease = _SESSIONS.acquire(key, build)
            self._session = self._lease.value
        else:
            self._session = build()
        # ONNX Runtime falls back to the CPU when a GPU provider fails to start: on
        # KIND_GPU that is a load failure, not a silently slow model
        if options.kind == "KIND_GPU" and providers[0][0] not in self._session.get_providers():
            self.close()
            raise invalid(
                f"model '{model}': ONNX Runtime could not start {providers[0][0]} "
                "(see its log above for why)"
            )
        self._model = model
        self.inputs = [_spec(a, model) for a in self._session.get_inputs()]
        self.outputs = [_spec(a, model) for a in self._session.get_outputs()]
        self._string_inputs = {s.name for s in self.inputs if s.datatype == "BYTES"}
        self._output_names = {s.name for s in self.outputs}
        # the CPU arena keeps the memory of the largest batch run: after a burst one
        # smallest run with arena shrinkage hands the rest back (release_memory)
        # InferenceSession.run may be called from any thread; a GPU provider's context
        # may not: only a CPU session runs a cheap lone request on the event loop
        self.inline_safe = self._session.get_providers() == ["CPUExecutionProvider"]
        self._shrinkable = (
            "CPUExecutionProvider" in self._session.get_providers() and not self._string_inputs
        )
        self._shrink_run: tuple[ort.RunOptions, dict[str, np.ndarray]] | None = None

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        check_inputs(self._model, self.inputs, inputs)
        unknown = [n for n in outputs if n not in self._output_names]
        if unknown:
            raise invalid(f"model '{self._model}' has no output(s) {unknown}")
        feed = inputs
        if self._string_inputs:
            feed = {
                k: _to_ort_strings(v, k) if k in self._string_inputs else v
                for k, v in inputs.items()
            }
        results = self._session.run(outputs, feed)
        return dict(zip(outputs, results, strict=True))

    def release_memory(self) -> None:
        """One run of the smallest input (every dynamic dim 1, zeros) with ONNX Runtime's
        arena shrinkage: the CPU arena frees what that run does not use, which is what
        the burst's big batches left. A model that refuses such an input keeps its
        arena as it is (logged once)."""
        if not self._shrinkable:
            return
        try:
            if self._shrink_run is None:
                options = ort.RunOptions()
                options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
                smallest = {
                    s.name: np.zeros([max(d, 1) for d in s.shape], to_numpy_dtype(s.datatype))
                    for s in self.inputs
                    if not s.optional
                }
                self._shrink_run = (options, smallest)
            options, smallest = self._shrink_run
            self._session.run([self.outputs[0].name], smallest, options)
            log.debug("model '%s': the CPU arena handed back what it does not use", self._model)
        except Exception as exc:  # the model's own rule for its inputs: no shrinking
            log.info("model '%s': its arena is not shrunk after bursts (%s)", self._model, exc)
            self._shrinkable = False

    def close(self) -> None:
        # dropping the last reference frees the session's arena and weights
        del self._session
        if self._lease is not None:
            self._lease.release()
