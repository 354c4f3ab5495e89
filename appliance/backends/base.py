"""The contract every inference backend implements.

A backend knows numpy arrays and files, nothing else: no asyncio, no protocols.
One backend object is one model instance; the instance group gives it a dedicated
worker thread, so ``infer`` is only ever called from that one thread at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from appliance import datatypes
from appliance.datatypes import TensorSpec as TensorSpec
from appliance.errors import invalid

# an engine's error text is kept whole up to this (OpenVINO names every failing node,
# then sums up), and its start and end past it
MESSAGE_CHARS = 16384


def engine_message(error: BaseException | str) -> str:
    """An engine's error as text for a load error or log line: stripped, whole up to
    :data:`MESSAGE_CHARS`, else its start and its end (the summary) with the count of
    characters left out between them."""
    text = str(error).strip()
    if len(text) <= MESSAGE_CHARS:
        return text
    keep = MESSAGE_CHARS // 2
    return f"{text[:keep]} ... [{len(text) - 2 * keep} characters left out] ... {text[-keep:]}"


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """What the lifecycle tells a backend when it creates an instance."""

    model_path: Path  # the model file (or folder) inside the version directory
    instance_index: int = 0
    instance_count: int = 1
    kind: str = "KIND_CPU"
    # threads this instance may use for one inference in an engine of its own (its
    # share of the cores)
    threads: int = 1
    # threads of an engine the instances of one copy share (ONNX Runtime's shared
    # session), whichever of them are busy: every usable core unless the config pins
    # intra_op_thread_count. 0: ``threads``. Never sent to a worker process, whose
    # engine is its own.
    shared_threads: int = 0
    parameters: dict[str, str] = field(default_factory=dict)
    # the config's max_batch_size; None when the config leaves it to auto-complete.
    # Engines with fixed shapes use it: OpenVINO reshapes a static batch dim, TensorRT
    # builds its optimization profile for it.
    max_batch_size: int | None = None
    # one loaded copy of a model version: every instance of the copy gets the same
    # value, the next load (a reload, a hot swap) a new one. An engine that shares
    # weights between instances keys its cache on it, so the old and the new copy
    # never share: each copy's memory is its own and is freed when it unloads.
    # "" (the default): no sharing between instances.
    share_group: str = ""
    # the tensors the config declares (with the batch dim as -1 where the model
    # batches) and the config as Triton's JSON text: for a backend with no graph to
    # read them from (Python models)
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    model_config: str = ""
    config_source: str = ""  # the config file, for error messages
    # the private key that opens sealed model files (appliance/backends/sealed.py); None: none
    key_file: Path | None = None

    @property
    def model_name(self) -> str:
        """The model's name (``<repository>/<model>/<version>/<file>``)."""
        return self.model_path.parent.parent.name


# the first bytes of a sealed (encrypted at rest) model file: appliance/backends/sealed.py
SEALED_MAGIC = b"APLSEAL1"


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    """What one instance holds, as its engine reports it.

    Weights shared by several instances are counted once, on the instance that
    loaded them, so summing over a model's instances gives the model's cost. The
    memory budget measures RSS and NVML itself; a report matters where those are
    blind, e.g. CUDA allocations on a Jetson (unified memory, no per-process NVML).
    """

    cpu_bytes: int = 0
    gpu_bytes: int = 0


class Backend(Protocol):
    """One loaded copy of a model.

    Ownership: the instance group creates it on a worker thread, calls ``infer``
    only from that thread, and calls ``close`` exactly once after the last infer.
    Failure: ``__init__`` raises on a model it cannot load (an ``ApplianceError``
    or any exception, which the lifecycle reports as a load failure); ``infer``
    raises on engine errors, which fail that batch only.
    """

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        """Run one (possibly batched) inference and return the named outputs."""
        ...

    def close(self) -> None:
        """Release the engine's memory; the object is unusable afterwards."""
        ...


class ReportsMemory(Protocol):
    """Optional: a backend that can say what it holds (TensorRT: its GPU memory)."""

    def memory_usage(self) -> MemoryUsage: ...


class InlineSafe(Protocol):
    """Optional: ``inline_safe`` True amends the thread rule above for this backend:
    its ``infer`` may also be called from the event loop's thread while its own thread
    takes no batch (a cheap lone request run in place of two thread hand-offs;
    ``core/batcher``). Only an engine whose run is thread-safe and needs no
    thread-bound context opts in (ONNX Runtime on the CPU)."""

    inline_safe: bool


class ReleasesMemory(Protocol):
    """Optional: a backend whose engine keeps working memory after a big batch (ONNX
    Runtime's CPU arena) and can hand what it does not use now back. Called on the
    instance's thread, between batches, after a burst of requests; must not raise."""

    def release_memory(self) -> None: ...


class BatchLimited(Protocol):
    """Optional: a backend whose engine caps the batch size (TensorRT profiles)."""

    max_batch_size: int


def memory_usage(backend: object) -> MemoryUsage | None:
    """The backend's reported memory, or None when it reports none."""
    report = getattr(backend, "memory_usage", None)
    if report is None:
        return None
    usage: MemoryUsage = report()
    return usage


def release_memory(backend: object) -> None:
    """Ask the backend to hand back the working memory it does not use now, if it can."""
    release = getattr(backend, "release_memory", None)
    if release is not None:
        release()


def batch_limit(backend: object) -> int | None:
    """The largest batch the backend's engine accepts, or None when it has no limit."""
    limit = getattr(backend, "max_batch_size", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_inputs(model: str, specs: Sequence[TensorSpec], inputs: dict[str, np.ndarray]) -> None:
    """Raise INVALID_ARG unless ``inputs`` has exactly the declared tensors with
    their datatypes and ranks, and fixed dims where the model fixes them.

    The model version already checks requests against its config; this is the
    engine's own guard, because some engines silently convert a wrong dtype or
    reuse the previous value of a missing input (OpenVINO does both).
    """
    declared = {s.name for s in specs}
    if not declared.issuperset(inputs):
        unknown = sorted(set(inputs) - declared)
        raise invalid(
            f"model '{model}' has no input(s) {unknown}; its inputs are {sorted(declared)}"
        )
    for spec in specs:
        arr = inputs.get(spec.name)
        if arr is None:
            if spec.optional:
                continue
            raise invalid(f"input '{spec.name}' of model '{model}' is missing")
        got = datatypes.from_numpy_dtype(arr.dtype)
        if got != spec.datatype:
            raise invalid(
                f"input '{spec.name}' of model '{model}': expected datatype {spec.datatype}, "
                f"got {got}"
            )
        if not spec.shape and arr.size == 1:
            continue  # [] is a scalar or a tensor of unknown rank (see config/completion)
        if not datatypes.fits(spec.shape, arr.shape):
            raise invalid(
                f"input '{spec.name}' of model '{model}': expected shape {list(spec.shape)}, "
                f"got {list(arr.shape)}"
            )

