"""TensorRT backend (NVIDIA GPUs: Jetson and x86), TensorRT 10 name-based tensor API.

Loads a serialized engine (``model.plan`` / ``model.engine``), or builds one from
``model.onnx`` on first load and caches it next to the model, keyed by TensorRT
version, GPU model and build options (:func:`tensorrt_support.engine_cache_path`):
engines are not portable across devices or TensorRT releases.

Weight sharing: the engine is deserialized once per loaded copy of a model
(``BackendOptions.share_group``; a reference-counted cache, :mod:`appliance.backends.shared`);
each instance owns an execution context, a CUDA
stream and its device + page-locked host buffers, allocated once at load for the
profile's largest shapes and reused by every call. CUDA: each instance retains the
device's primary context and keeps it current on its own worker thread (the
instance group creates, runs and closes an instance on one thread), so nothing
depends on ``pycuda.autoinit``.

Batching follows the engine's optimization profile: the instance reports the
profile's largest batch as ``max_batch_size`` (auto-complete caps at it) and a
config asking for more is refused at load. GPU memory (engine + context scratch +
buffers) is reported by ``memory_usage``.

Untested on this project's CI (no GPU): ``benchmarks/gpu_check.sh`` exercises it
wherever an NVIDIA GPU is available.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pycuda.driver as cuda
import tensorrt as trt

from appliance.backends import sealed
from appliance.backends.base import BackendOptions, MemoryUsage, TensorSpec, check_inputs
from appliance.backends.shared import Lease, SharedCache, file_identity
from appliance.backends.tensorrt_support import (
    DEFAULT_BUILD_MAX_BATCH,
    TRT_TYPES,
    ProfileShapes,
    TrtSettings,
    batch_limits,
    build_profile,
    check_shape,
    engine_cache_path,
    exposed_batch,
    settings,
)
from appliance.errors import internal, invalid

log = logging.getLogger(__name__)
_LOGGER = trt.Logger(trt.Logger.WARNING)


class _Engine:
    """A deserialized engine shared by a model's instances."""

    def __init__(self, runtime: Any, engine: Any, size: int) -> None:
        self.runtime = runtime
        self.engine = engine
        self.size = size  # serialized bytes: the weights' share of GPU memory, roughly

    def close(self) -> None:
        # drop the engine before its runtime (TensorRT's destruction order)
        self.engine = None
        self.runtime = None


_ENGINES: SharedCache[_Engine] = SharedCache(close=_Engine.close)


def _build(
    onnx_path: Path, s: TrtSettings, config_max: int | None, model: str, plain: bytes | None
) -> bytes:
    """Build an engine from ONNX (minutes on a Jetson), or read the cached one. A
    sealed ONNX (``plain``: its bytes, opened in memory) is parsed from memory and its
    engine is neither cached nor read from a cache: an engine file is the model."""
    device = cuda.Device(s.device_id)
    max_batch = config_max if config_max else DEFAULT_BUILD_MAX_BATCH
    builder = trt.Builder(_LOGGER)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, _LOGGER)
    parsed = parser.parse(plain) if plain is not None else parser.parse_from_file(str(onnx_path))
    if not parsed:
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise invalid(f"model '{model}': TensorRT cannot parse {onnx_path.name}: {errors}")
    inputs = [
        (network.get_input(i).name, tuple(network.get_input(i).shape))
        for i in range(network.num_inputs)
    ]
    batched = config_max != 0 and all(shape and shape[0] == -1 for _, shape in inputs)
    if config_max and not batched:
        build_profile(model, inputs, True, max_batch)  # raises the precise error
    profile_shapes = build_profile(model, inputs, batched, max_batch)
    path = engine_cache_path(
        onnx_path,
        trt.__version__,
        device.name(),
        device.compute_capability(),
        s.precision,
        max_batch if batched else 0,
    )
    if plain is None and path.exists():
        log.info("model '%s': using the cached TensorRT engine %s", model, path.name)
        return path.read_bytes()
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, s.workspace_mib << 20)
    if s.precision == "FP16":
        config.set_flag(trt.BuilderFlag.FP16)
    else:
        # FP32 means FP32: TF32 (on by default on Ampere+) would round to 10-bit mantissas
        config.clear_flag(trt.BuilderFlag.TF32)
    if profile_shapes:
        profile = builder.create_optimization_profile()
        for p in profile_shapes:
            profile.set_shape(p.name, p.min, p.opt, p.max)
        config.add_optimization_profile(profile)
    log.info(
        "model '%s': building a TensorRT %s engine from %s for %s (first load on this "
        "device; this can take minutes)",
        model,
        s.precision,
        onnx_path.name,
        device.name(),
    )
    started = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise invalid(f"model '{model}': TensorRT could not build an engine (see its log above)")
    data = bytes(serialized)
    log.info("model '%s': engine built in %.0fs", model, time.perf_counter() - started)
    if plain is not None:
        return data  # sealed: never on disk
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half an engine
    except OSError as exc:
        log.warning("model '%s': engine not cached (%s); it is rebuilt on next load", model, exc)
        tmp.unlink(missing_ok=True)
    return data


def _load(
    path: Path, s: TrtSettings, config_max: int | None, model: str, key_file: Path | None
) -> _Engine:
    # a sealed file (a plan, or an ONNX to build from) opens into memory
    plain = sealed.read_model(path, key_file)
    if path.suffix == ".onnx":
        data = _build(path, s, config_max, model, plain)
    else:
        data = plain if plain is not None else path.read_bytes()
    runtime = trt.Runtime(_LOGGER)
    engine = runtime.deserialize_cuda_engine(data)
    if engine is None:
        raise invalid(
            f"model '{model}': TensorRT {trt.__version__} cannot deserialize {path.name}; "
            "an engine only loads on the TensorRT version and GPU model that built it"
        )
    return _Engine(runtime, engine, len(data))


@dataclass(frozen=True, slots=True)
class _Buffer:
    device: Any  # pycuda DeviceAllocation
    host: np.ndarray  # page-locked, flat, sized for the largest shape
    nbytes: int


class TensorRtBackend:
    """One execution context (with its stream and buffers) on a shared engine."""

    def __init__(self, options: BackendOptions) -> None:
        self._model = model = options.model_name
        self.settings = s = settings(options)
        cuda.init()
        self._cuda = cuda.Device(s.device_id).retain_primary_context()
        self._cuda.push()
        self._buffers: dict[str, _Buffer] = {}
        self._lease: Lease[_Engine] | None = None
        self._closed = False
        try:
            self._lease = _ENGINES.acquire(
                (
                    options.share_group or object(),  # no group: no sharing
                    file_identity(options.model_path),
                    s,
                    options.max_batch_size,
                ),
                lambda: _load(
                    options.model_path, s, options.max_batch_size, model, options.key_file
                ),
            )
            self._setup(self._lease.value, options.max_batch_size)
        except BaseException:
            self.close()
            raise

    def _setup(self, shared: _Engine, config_max: int | None) -> None:
        engine, model, s = shared.engine, self._model, self.settings
        if not 0 <= s.profile < max(1, engine.num_optimization_profiles):
            raise invalid(
                f"model '{model}': optimization_profile {s.profile} does not exist "
                f"(the engine has {engine.num_optimization_profiles})"
            )
        self._stream = cuda.Stream()
        self._context = engine.create_execution_context()
        if self._context is None:
            raise internal(f"model '{model}': TensorRT could not create an execution context")
        if s.profile:
            self._context.set_optimization_profile_async(s.profile, self._stream.handle)
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self._dtypes: dict[str, np.dtype[Any]] = {}
        self.inputs: list[TensorSpec] = []
        self.outputs: list[TensorSpec] = []
        declared: list[tuple[str, tuple[int, ...]]] = []
        self._profile: dict[str, ProfileShapes] = {}
        for name in names:
            dtype = engine.get_tensor_dtype(name)
            datatype = TRT_TYPES.get(dtype.name)
            if datatype is None:
                raise invalid(f"model '{model}': tensor '{name}' has type {dtype.name}, not served")
            self._dtypes[name] = np.dtype(trt.nptype(dtype))
            shape = tuple(engine.get_tensor_shape(name))
            spec = TensorSpec(name, datatype, shape)
            if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                self.inputs.append(spec)
                declared.append((name, shape))
                lo, opt, hi = (
                    tuple(engine.get_tensor_profile_shape(name, s.profile))
                    if -1 in shape
                    else (shape, shape, shape)
                )
                self._profile[name] = ProfileShapes(name, tuple(lo), tuple(opt), tuple(hi))
            else:
                self.outputs.append(spec)
        limits = batch_limits(declared, list(self._profile.values()))
        self.max_batch_size = exposed_batch(model, config_max, limits)
        # the largest shapes: every input at its profile max, outputs as that implies
        for spec in self.inputs:
            self._context.set_input_shape(spec.name, self._profile[spec.name].max)
        largest = {spec.name: self._profile[spec.name].max for spec in self.inputs}
        for spec in self.outputs:
            shape = tuple(self._context.get_tensor_shape(spec.name))
            if any(d < 0 for d in shape):
                raise invalid(
                    f"model '{model}': output '{spec.name}' has a data-dependent shape, "
                    "which the TensorRT backend does not serve"
                )
            largest[spec.name] = shape
        for name, shape in largest.items():
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            host = cuda.pagelocked_empty(max(1, count), self._dtypes[name])
            device = cuda.mem_alloc(max(1, host.nbytes))
            self._buffers[name] = _Buffer(device, host, host.nbytes)
            self._context.set_tensor_address(name, int(device))
        self._output_names = {spec.name for spec in self.outputs}
        scratch = getattr(engine, "device_memory_size_v2", None) or engine.device_memory_size
        weights = shared.size if self._lease is not None and self._lease.first else 0
        self._gpu_bytes = int(scratch) + weights + sum(b.nbytes for b in self._buffers.values())

    def memory_usage(self) -> MemoryUsage:
        """GPU bytes: the context's scratch memory, its buffers, and the engine (charged
        to the instance that loaded it)."""
        return MemoryUsage(gpu_bytes=self._gpu_bytes)

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        check_inputs(self._model, self.inputs, inputs)
        unknown = [n for n in outputs if n not in self._output_names]
        if unknown:
            raise invalid(f"model '{self._model}' has no output(s) {unknown}")
        ctx, stream = self._context, self._stream
        for spec in self.inputs:
            arr = inputs[spec.name]
            check_shape(self._model, spec.name, arr.shape, self._profile[spec.name])
            ctx.set_input_shape(spec.name, arr.shape)
            buf = self._buffers[spec.name]
            staged = buf.host[: arr.size].reshape(arr.shape)
            np.copyto(staged, arr)  # into page-locked memory: the copy to the GPU is async
            cuda.memcpy_htod_async(buf.device, staged, stream)
        if not ctx.execute_async_v3(stream.handle):
            raise internal(f"model '{self._model}': TensorRT execution failed (see its log)")
        counts: dict[str, tuple[tuple[int, ...], int]] = {}
        for name in outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            counts[name] = (shape, count)
            buf = self._buffers[name]
            cuda.memcpy_dtoh_async(buf.host[:count], buf.device, stream)
        stream.synchronize()
        # copies: the host buffers are reused by the next call
        return {
            name: self._buffers[name].host[:count].reshape(shape).copy()
            for name, (shape, count) in counts.items()
        }

    def close(self) -> None:
        """Free the buffers, context and stream, then (last instance) the engine; on
        this instance's own thread, with its CUDA context current."""
        if self._closed:
            return
        self._closed = True
        try:
            for buf in self._buffers.values():
                buf.device.free()
            self._buffers.clear()
            self._context = None
            self._stream = None
            if self._lease is not None:
                self._lease.release()
        finally:
            self._cuda.pop()
            self._cuda.detach()
