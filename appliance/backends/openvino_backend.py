"""OpenVINO backend: IR (``model.xml`` + ``model.bin``) and ONNX files, CPU by default.

Weight sharing: an instance group of N is ONE compiled model with N infer requests.
The first instance to load reads and compiles the model (for the device, with a
performance hint of LATENCY for one instance and THROUGHPUT for several, sized to N
requests); the others find it and each create their own infer request. The
compiled model lives in a small per-process cache keyed by the loaded copy
(``BackendOptions.share_group``: a reload or hot swap gets a new one), the model
file's identity and the compile settings, reference-counted, and is freed with the
copy's last instance (:mod:`appliance.backends.shared`).

Batching: a dynamic first dimension is used as it is. When the config batches
(``max_batch_size > 0``) and an input has a static first dimension of 1 (the usual
static export), the model is reshaped to a dynamic batch before compiling; any other
static shape is refused with an error saying how to fix it.

BYTES (string) tensors are refused at load: OpenVINO's numpy bridge drops trailing
NUL bytes and, in 2026.4, crashes the process when a string identity model is freed.
INT64 is computed as INT32 by OpenVINO's CPU and GPU plugins:
INT64 inputs are served, but a request with a value outside the INT32 range is
refused (INVALID_ARG) rather than silently truncated.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from appliance.backends import sealed
from appliance.backends.base import BackendOptions, TensorSpec, check_inputs, engine_message
from appliance.backends.parameters import Parameters
from appliance.backends.shared import SharedCache, file_identity
from appliance.errors import invalid

log = logging.getLogger(__name__)

INT32 = np.iinfo(np.int32)
HINTS = ("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT")
PRECISIONS = ("f32", "bf16", "f16")
# devices that choose or combine others; their names take a ":" list after them
META_DEVICES = ("AUTO", "MULTI", "HETERO", "BATCH")
KIND_DEVICES = {"KIND_CPU": "CPU", "KIND_GPU": "GPU", "KIND_AUTO": "AUTO"}

# OpenVINO element type names -> KServe datatypes (string: see the module docstring)
_TYPES = {
    "boolean": "BOOL",
    "u8": "UINT8",
    "u16": "UINT16",
    "u32": "UINT32",
    "u64": "UINT64",
    "i8": "INT8",
    "i16": "INT16",
    "i32": "INT32",
    "i64": "INT64",
    "f16": "FP16",
    "f32": "FP32",
    "f64": "FP64",
}


@dataclass(frozen=True, slots=True)
class OpenVinoSettings:
    """How one model is compiled; read from its config by :func:`settings`."""

    device: str  # CPU, GPU, NPU, AUTO, AUTO:GPU,CPU, ...
    hint: str  # LATENCY | THROUGHPUT | CUMULATIVE_THROUGHPUT
    requests: int  # infer requests on the compiled model = the instance count
    threads: int  # CPU threads of the compiled model in total; 0: OpenVINO decides
    streams: int  # 0: from the hint
    precision: str  # "" = the device's default

    def properties(self) -> dict[str, str]:
        """The ``compile_model`` properties."""
        props = {
            "PERFORMANCE_HINT": self.hint,
            "PERFORMANCE_HINT_NUM_REQUESTS": str(self.requests),
        }
        if self.device == "CPU":
            # pinned streams of two models would fight over the same cores, and the event
            # loop needs a core too: let the OS schedule, as the ONNX Runtime backend does
            props["ENABLE_CPU_PINNING"] = "NO"
            if self.threads:
                props["INFERENCE_NUM_THREADS"] = str(self.threads)
        if self.streams:
            props["NUM_STREAMS"] = str(self.streams)
        if self.precision:
            props["INFERENCE_PRECISION_HINT"] = self.precision
        return props


def settings(options: BackendOptions) -> OpenVinoSettings:
    """Compile settings from the config: ``parameters`` (``device``,
    ``performance_hint``, ``num_streams``, ``inference_num_threads``,
    ``inference_precision``; Triton's upper-case names are accepted too), the
    instance group (count -> requests and default hint; kind -> default device) and
    the instance's thread share."""
    p = Parameters(options.model_name, options.parameters)
    found = p.raw("device", "DEVICE")
    device = found[1].upper() if found else KIND_DEVICES.get(options.kind, "CPU")
    if not device:
        raise invalid(f"model '{options.model_name}': parameters.device: expected a device name")
    count = max(1, options.instance_count)
    hint = p.choice(
        ("performance_hint", "PERFORMANCE_HINT"), HINTS, "LATENCY" if count == 1 else "THROUGHPUT"
    )
    threads = p.integer(
        ("inference_num_threads", "INFERENCE_NUM_THREADS"), max(1, options.threads) * count
    )
    streams = p.integer(("num_streams", "NUM_STREAMS"), 0)
    # f32 on CPU unless asked: OpenVINO would pick bf16 on CPUs with AMX, and results
    # would then differ from every other backend's by far more than rounding
    precision = p.choice(
        ("inference_precision", "INFERENCE_PRECISION_HINT"),
        PRECISIONS,
        "f32" if device == "CPU" else "",
    )
    return OpenVinoSettings(device, hint, count, threads, streams, precision)


@dataclass(frozen=True, slots=True)
class _Compiled:
    model: ov.CompiledModel
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


_core: ov.Core | None = None
_core_lock = threading.Lock()
# one compiled model per (file, settings, batch); see backends.shared
_COMPILED: SharedCache[_Compiled] = SharedCache(close=lambda compiled: None)


def _get_core() -> ov.Core:
    global _core
    with _core_lock:
        if _core is None:
            _core = ov.Core()
        return _core


def _check_device(core: ov.Core, device: str, model: str) -> None:
    base = device.split(":")[0]
    if base in META_DEVICES:
        return
    available = list(core.available_devices)  # CPU, GPU.0, GPU.1, NPU, ...
    if base not in available and base not in {d.split(".")[0] for d in available}:
        raise invalid(
            f"model '{model}': OpenVINO device '{device}' is not available here; "
            f"available: {available} (or AUTO)"
        )


def _spec(port: ov.Output, model: str, kind: str, name: str = "") -> TensorSpec:
    """The tensor ``port`` serves, named ``name`` (one of its names) or its any-name."""
    names = port.get_names()
    if not names:
        raise invalid(f"model '{model}': an {kind} of the model has no tensor name")
    name = name or port.get_any_name()
    element = port.get_element_type().get_type_name()
    datatype = _TYPES.get(element)
    if element == "string":
        raise invalid(
            f"model '{model}': {kind} '{name}' is a string tensor; string tensors are not "
            "supported by the OpenVINO backend, use backend: onnxruntime for this model"
        )
    if datatype is None:
        raise invalid(
            f"model '{model}': {kind} '{name}' has type {element}, which the OpenVINO "
            "backend does not serve"
        )
    shape = port.get_partial_shape()
    if shape.rank.is_dynamic:
        raise invalid(f"model '{model}': {kind} '{name}' has a dynamic rank, which is not served")
    return TensorSpec(name, datatype, tuple(d.get_length() if d.is_static else -1 for d in shape))


def _batchable(ov_model: ov.Model, max_batch: int, model: str) -> None:
    """Give every input a dynamic first dim (reshaping a static 1), or refuse."""
    reshape: dict[ov.Output, ov.PartialShape] = {}
    for port in ov_model.inputs:
        shape = port.get_partial_shape()
        name = port.get_any_name()
        if shape.rank.is_dynamic or shape.rank.get_length() == 0 or shape[0].is_dynamic:
            continue  # rank problems are reported by _spec; dynamic batch is what we want
        if shape[0].get_length() != 1:
            raise invalid(
                f"model '{model}': max_batch_size {max_batch} needs a batch dimension, but "
                f"input '{name}' has the static shape {shape}; export the model with a dynamic "
                "(or 1) first dimension, or set max_batch_size: 0"
            )
        reshape[port] = ov.PartialShape([ov.Dimension(-1), *list(shape)[1:]])
    if not reshape:
        return
    log.info("model '%s': reshaping its static batch dimension to a dynamic one", model)
    try:
        ov_model.reshape(reshape)
    except RuntimeError as exc:
        raise invalid(
            f"model '{model}': its batch dimension is static and OpenVINO cannot reshape it "
            f"for max_batch_size {max_batch} ({str(exc).strip().splitlines()[-1]}); export "
            "it with a dynamic first dimension, or set max_batch_size: 0"
        ) from None
    for port in ov_model.outputs:
        shape = port.get_partial_shape()
        if shape.rank.is_static and shape.rank.get_length() > 0 and shape[0].is_static:
            raise invalid(
                f"model '{model}': after reshaping to a dynamic batch, output "
                f"'{port.get_any_name()}' still has the static shape {shape}; "
                "set max_batch_size: 0"
            )


def _name(port: ov.Output, wanted: frozenset[str]) -> str:
    """The name a port of the model as read is served under: the one the config
    declares among its names, else its any-name."""
    declared = sorted(wanted.intersection(port.get_names()))
    return declared[0] if declared else port.get_any_name()


def _specs(ports: list[ov.Output], read: list[str], model: str, kind: str) -> list[TensorSpec]:
    """The compiled ``ports``, each named as the same port of the model as read (when
    it still answers to that name, else by its any-name)."""
    if len(read) != len(ports):
        read = [""] * len(ports)
    return [
        _spec(port, model, kind, name if name in port.get_names() else "")
        for port, name in zip(ports, read, strict=True)
    ]


def _read(core: ov.Core, path: Path, key_file: Path | None) -> ov.Model:
    """The model as read from its file(s), a sealed one from memory (an IR's weights
    as a tensor over the decrypted bytes): nothing decrypted is written anywhere."""
    data = sealed.read_model(path, key_file)
    if path.suffix != ".xml":
        return core.read_model(data if data is not None else str(path))
    weights_path = path.with_suffix(".bin")
    weights = sealed.read_model(weights_path, key_file)
    if data is None and weights is None:
        return core.read_model(str(path))
    xml = data if data is not None else path.read_bytes()
    binary = weights if weights is not None else weights_path.read_bytes()
    return core.read_model(xml, ov.Tensor(np.frombuffer(binary, np.uint8)))


def _compile(
    path: Path,
    s: OpenVinoSettings,
    max_batch: int,
    model: str,
    wanted: frozenset[str],
    key_file: Path | None = None,
) -> _Compiled:
    started = time.perf_counter()
    core = _get_core()
    _check_device(core, s.device, model)
    log.info(
        "model '%s': OpenVINO compiling %s for %s (hint %s, %d request(s))",
        model,
        path.name,
        s.device,
        s.hint,
        s.requests,
    )
    try:
        ov_model = _read(core, path, key_file)
    except RuntimeError as exc:
        raise invalid(
            f"model '{model}': OpenVINO cannot read {path.name}: {engine_message(exc)}"
        ) from None
    for port in ov_model.inputs:
        _spec(port, model, "input")
    # the names as read: compiling can give a port more names (an ``If`` inlined adds
    # its branch's), and the any-name of the compiled port may then be an internal one
    read_in = [_name(port, wanted) for port in ov_model.inputs]
    read_out = [_name(port, wanted) for port in ov_model.outputs]
    if max_batch > 0:
        _batchable(ov_model, max_batch, model)
    try:
        compiled = core.compile_model(ov_model, s.device, s.properties())
    except RuntimeError as exc:
        raise invalid(
            f"model '{model}': OpenVINO cannot compile {path.name} for {s.device}: "
            f"{engine_message(exc)}"
        ) from None
    del ov_model  # the compiled model keeps what it needs
    inputs = _specs(compiled.inputs, read_in, model, "input")
    outputs = _specs(compiled.outputs, read_out, model, "output")
    log.info("model '%s': OpenVINO compiled in %.2fs", model, time.perf_counter() - started)
    return _Compiled(compiled, inputs, outputs)


class OpenVinoBackend:
    """One infer request on a compiled model shared by the model's instances."""

    def __init__(self, options: BackendOptions) -> None:
        self._model = options.model_name
        path = options.model_path
        files = [path]
        if path.suffix == ".xml":
            files.append(path.with_suffix(".bin"))
            if not files[1].exists():
                raise invalid(
                    f"model '{self._model}': {path.name} needs {files[1].name} next to it"
                )
        self.settings = settings(options)
        max_batch = options.max_batch_size or 0
        # instances of one loaded copy share (BackendOptions.share_group); without a
        # group each instance compiles its own
        group = options.share_group or object()
        key = (group, file_identity(*files), self.settings, max_batch)
        # names the config declares: an output with several names is served by that one
        wanted = frozenset(spec.name for spec in (*options.inputs, *options.outputs))
        self._lease = _COMPILED.acquire(
            key,
            lambda: _compile(path, self.settings, max_batch, self._model, wanted, options.key_file),
        )
        shared = self._lease.value
        try:
            self._request = shared.model.create_infer_request()
        except BaseException:
            self._lease.release()
            raise
        self.inputs = shared.inputs
        self.outputs = shared.outputs
        self._output_names = {s.name for s in self.outputs}
        self._int64_inputs = [s.name for s in self.inputs if s.datatype == "INT64"]

    @property
    def compiled_model(self) -> ov.CompiledModel:
        """The compiled model this instance shares with the rest of its group."""
        return self._lease.value.model

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        check_inputs(self._model, self.inputs, inputs)
        unknown = [n for n in outputs if n not in self._output_names]
        if unknown:
            raise invalid(f"model '{self._model}' has no output(s) {unknown}")
        for name in self._int64_inputs:
            arr = inputs[name]
            if arr.size and (arr.min() < INT32.min or arr.max() > INT32.max):
                raise invalid(
                    f"input '{name}' of model '{self._model}': OpenVINO computes INT64 as "
                    f"INT32, and this tensor has values outside {INT32.min}..{INT32.max}"
                )
        # share_inputs: no copy of the (batched) input; outputs are copied out of the
        # request's buffers, which the next infer reuses
        result = self._request.infer(inputs, share_inputs=True, share_outputs=False)
        return {name: result[name] for name in outputs}

    def close(self) -> None:
        # the request first: the compiled model is freed with the last lease
        del self._request
        self._lease.release()
