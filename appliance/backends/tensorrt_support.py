"""The TensorRT backend's decisions as pure functions (no tensorrt, no GPU needed).

Kept apart from :mod:`appliance.backends.tensorrt_backend` so that the settings, the
optimization-profile batch limits and the engine cache key are tested on any
machine; the backend module itself needs ``tensorrt`` and ``pycuda``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance.backends.base import BackendOptions
from appliance.backends.parameters import Parameters
from appliance.errors import invalid

# TensorRT DataType names -> KServe datatypes (BF16, FP8, INT4 have no KServe twin)
TRT_TYPES = {
    "FLOAT": "FP32",
    "HALF": "FP16",
    "INT8": "INT8",
    "INT32": "INT32",
    "INT64": "INT64",
    "BOOL": "BOOL",
    "UINT8": "UINT8",
}
# the batch size an engine is built for when the config leaves max_batch_size to
# auto-complete (the server's default_max_batch_size, 8, unless changed)
DEFAULT_BUILD_MAX_BATCH = 8
Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TrtSettings:
    """From the config's ``parameters``: ``precision`` (FP32 | FP16: engines built
    from ONNX), ``device_id`` (default 0), ``workspace_mib`` (builder scratch,
    default 1024), ``optimization_profile`` (the profile an instance uses, default 0)."""

    precision: str
    device_id: int
    workspace_mib: int
    profile: int


def settings(options: BackendOptions) -> TrtSettings:
    p = Parameters(options.model_name, options.parameters)
    return TrtSettings(
        precision=p.choice(("precision",), ("FP32", "FP16"), "FP32"),
        device_id=p.integer(("device_id",), 0),
        workspace_mib=p.integer(("workspace_mib",), 1024, minimum=1),
        profile=p.integer(("optimization_profile",), 0),
    )


@dataclass(frozen=True, slots=True)
class ProfileShapes:
    """One input's shapes in one optimization profile."""

    name: str
    min: Shape
    opt: Shape
    max: Shape


def batch_limits(
    declared: Sequence[tuple[str, Shape]], profile: Sequence[ProfileShapes]
) -> tuple[int, int] | None:
    """(smallest, largest) batch every input's profile accepts, or None when the
    engine does not batch (some input's first dim is static, or an input is a scalar).

    ``declared``: each input's engine shape (-1 = dynamic); ``profile``: the same
    inputs' profile shapes. Raises INVALID_ARG if the profile's ranges don't overlap.
    """
    if not declared or any(not shape or shape[0] != -1 for _, shape in declared):
        return None
    by_name = {p.name: p for p in profile}
    lo = max(by_name[name].min[0] for name, _ in declared)
    hi = min(by_name[name].max[0] for name, _ in declared)
    if lo > hi:
        raise invalid(
            f"the engine's optimization profile gives its inputs disjoint batch ranges "
            f"(smallest common batch {lo} > largest {hi})"
        )
    return lo, hi


def exposed_batch(model: str, config_max: int | None, limits: tuple[int, int] | None) -> int:
    """The largest batch the instance accepts (0: it does not batch), checked against
    the config's ``max_batch_size`` (None: auto-complete, which then caps at it)."""
    if limits is None:
        if config_max:
            raise invalid(
                f"model '{model}': max_batch_size {config_max} needs a dynamic batch dimension, "
                "but the engine's inputs have a static first dimension; set max_batch_size: 0 "
                "or rebuild the engine with a dynamic batch profile"
            )
        return 0
    lo, hi = limits
    if config_max and lo > 1:
        raise invalid(
            f"model '{model}': the engine's optimization profile needs a batch of at least "
            f"{lo}, but the batcher sends 1..max_batch_size rows; rebuild it with min batch 1"
        )
    if config_max and config_max > hi:
        raise invalid(
            f"model '{model}': max_batch_size {config_max} exceeds the engine's "
            f"optimization profile (batch up to {hi}); set max_batch_size <= {hi}"
        )
    return hi


def check_shape(model: str, name: str, shape: Shape, p: ProfileShapes) -> None:
    """INVALID_ARG unless ``shape`` lies within the profile's min..max, dim by dim."""
    if len(shape) != len(p.min) or any(
        not lo <= d <= hi for d, lo, hi in zip(shape, p.min, p.max, strict=True)
    ):
        ranges = [
            f"{lo}..{hi}" if lo != hi else str(lo) for lo, hi in zip(p.min, p.max, strict=True)
        ]
        raise invalid(
            f"input '{name}' of model '{model}': shape {list(shape)} is outside the engine's "
            f"optimization profile [{', '.join(ranges)}]"
        )


def build_profile(
    model: str, inputs: Sequence[tuple[str, Shape]], batched: bool, max_batch: int
) -> list[ProfileShapes]:
    """Profile shapes for building an engine from ONNX: batch 1..max_batch (optimized
    for max_batch, which dynamic batching produces under load), every other dim fixed.

    Returns [] when every input is static (no profile needed). A dynamic non-batch
    dim can't be guessed: refused, with how to build such an engine instead.
    """
    out = []
    for name, shape in inputs:
        rest = shape[1:] if batched else shape
        if batched and (not shape or shape[0] != -1):
            raise invalid(
                f"model '{model}': max_batch_size > 0 needs a dynamic first dimension, but "
                f"input '{name}' has shape {list(shape)}"
            )
        if any(d < 0 for d in rest):
            raise invalid(
                f"model '{model}': input '{name}' has dynamic dims besides the batch "
                f"({list(shape)}); build the engine yourself (trtexec --minShapes/--optShapes/"
                "--maxShapes) and serve model.plan"
            )
        if batched:
            out.append(ProfileShapes(name, (1, *rest), (max_batch, *rest), (max_batch, *rest)))
    return out


def engine_cache_path(
    onnx_path: Path,
    trt_version: str,
    gpu_name: str,
    compute_capability: tuple[int, int],
    precision: str,
    max_batch: int,
) -> Path:
    """Where the engine built from ``onnx_path`` is cached, next to it.

    An engine only runs on the TensorRT version and GPU model that built it, so both
    are in the name, with what shaped the build (precision, max batch) and a digest
    of the ONNX file, so a changed model is rebuilt rather than served stale.
    """
    digest = hashlib.sha256(onnx_path.read_bytes()).hexdigest()[:16]
    gpu = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "gpu"
    major, minor = compute_capability
    return onnx_path.with_name(
        f"{onnx_path.stem}.trt{trt_version}.{gpu}.sm{major}{minor}."
        f"{precision.lower()}.b{max_batch}.{digest}.engine"
    )
