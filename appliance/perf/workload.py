"""What ``appliance perf`` sends: input tensors for one model, built before the run.

The model's inputs come from its metadata (``GET /v2/models/{m}``) or from the
in-process server; variable dimensions must be given with ``--shape NAME:d1,d2``.
Data is random, zeros, or read from files: a folder of files feeds a BYTES input
(one file per element, e.g. JPEG frames), a ``.npy`` file or a raw file of the right
size feeds a fixed-size input. A few samples are made up front and cycled through,
so no per-request work is spent building data while measuring.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from appliance.datatypes import DATATYPES, element_count, to_numpy_dtype
from appliance.errors import invalid

DATA_MODES = ("random", "zeros", "files")
# files bigger than this are refused: a benchmark input, not a data set
MAX_FILE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One input or output of the model, shape including the batch dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def fixed_bytes(self) -> int | None:
        """Byte size of a fixed-size tensor (None for BYTES or unknown dimensions)."""
        if self.datatype == "BYTES" or any(d < 0 for d in self.shape):
            return None
        return element_count(self.shape) * to_numpy_dtype(self.datatype).itemsize


def parse_shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``NAME:1,3,224,224`` options into a mapping (dimensions without the batch)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.rpartition(":")
        try:
            values = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            values = ()
        if not sep or not name or not values or any(v < 0 for v in values):
            raise invalid(f"--shape {item!r}: expected NAME:d1,d2,... with dimensions >= 0")
        shapes[name] = values
    return shapes


def specs_from_metadata(
    metadata: Mapping[str, Any],
    key: str,
    batch_size: int,
    batched: bool,
    shapes: Mapping[str, tuple[int, ...]],
) -> list[TensorSpec]:
    """The model's ``inputs`` or ``outputs`` with the batch size and ``--shape`` applied."""
    specs: list[TensorSpec] = []
    for entry in metadata.get(key) or []:
        name, datatype = str(entry.get("name", "")), str(entry.get("datatype", ""))
        if datatype not in DATATYPES:
            raise invalid(f"{key[:-1]} '{name}': unsupported datatype {datatype!r}")
        dims = [int(d) for d in entry.get("shape") or []]
        if batched and dims:
            dims = dims[1:]  # metadata shapes carry -1 for the batch dimension
        if name in shapes:
            dims = list(shapes[name])
        if key == "inputs" and any(d < 0 for d in dims):
            raise invalid(
                f"input '{name}' has variable dimensions {dims}: give them with "
                f"--shape {name}:d1,d2,..."
            )
        full = (batch_size, *dims) if batched else tuple(dims)
        specs.append(TensorSpec(name, datatype, full))
    if key == "inputs" and not specs:
        raise invalid("the model's metadata lists no inputs")
    return specs


def _random(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    if spec.datatype == "BYTES":
        flat = np.empty(element_count(spec.shape), dtype=object)
        flat[:] = [rng.bytes(16) for _ in range(flat.size)]
        return flat.reshape(spec.shape)
    dtype = to_numpy_dtype(spec.datatype)
    if dtype.kind == "f":
        return rng.random(spec.shape, dtype=np.float64).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, spec.shape).astype(dtype)
    # small values: "random" should not overflow an add/sub model or index tables
    return rng.integers(0, 100, spec.shape).astype(dtype)


def _zeros(spec: TensorSpec) -> np.ndarray:
    if spec.datatype == "BYTES":
        flat = np.empty(element_count(spec.shape), dtype=object)
        flat[:] = [b""] * flat.size
        return flat.reshape(spec.shape)
    return np.zeros(spec.shape, dtype=to_numpy_dtype(spec.datatype))


def _read(path: Path) -> bytes:
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise invalid(f"{path}: {size} bytes, more than the {MAX_FILE_BYTES} a sample may have")
    return path.read_bytes()


def _from_files(spec: TensorSpec, source: Path, count: int) -> list[np.ndarray]:
    """Samples of ``spec`` from ``source``: a folder (BYTES: one file per element,
    cycled), or one file (``.npy``, or raw bytes of exactly the tensor's size)."""
    if spec.datatype == "BYTES":
        files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
        if not files:
            raise invalid(f"input '{spec.name}': no files in {source}")
        blobs = [_read(p) for p in files]
        n = element_count(spec.shape)
        samples = []
        for i in range(max(1, min(count, len(blobs)))):
            flat = np.empty(n, dtype=object)
            flat[:] = [blobs[(i * n + j) % len(blobs)] for j in range(n)]
            samples.append(flat.reshape(spec.shape))
        return samples
    path = source / f"{spec.name}.npy" if source.is_dir() else source
    if not path.is_file() and source.is_dir():
        path = source / spec.name
    if not path.is_file():
        raise invalid(f"input '{spec.name}': no file {path}")
    dtype = to_numpy_dtype(spec.datatype)
    if path.suffix == ".npy":
        arr = np.load(path, allow_pickle=False)
        if arr.size != element_count(spec.shape):
            raise invalid(f"{path}: {arr.size} elements, input '{spec.name}' needs {spec.shape}")
        return [np.ascontiguousarray(arr.astype(dtype, copy=False).reshape(spec.shape))]
    raw = _read(path)
    need = spec.fixed_bytes
    if need is None or len(raw) != need:
        raise invalid(f"{path}: {len(raw)} bytes, input '{spec.name}' needs {need}")
    return [np.frombuffer(raw, dtype=dtype).reshape(spec.shape)]


def make_samples(
    specs: Sequence[TensorSpec],
    mode: str = "random",
    source: Path | None = None,
    count: int = 4,
    seed: int = 0,
) -> list[dict[str, np.ndarray]]:
    """``count`` request inputs (fewer when the files give fewer), cycled by the runner."""
    if mode not in DATA_MODES:
        raise invalid(f"input data {mode!r}: choose one of {', '.join(DATA_MODES)}")
    if mode == "files" and source is None:
        raise invalid("--input-data files needs --input-files PATH")
    rng = np.random.default_rng(seed)
    per_input: dict[str, list[np.ndarray]] = {}
    for spec in specs:
        if mode == "zeros":
            per_input[spec.name] = [_zeros(spec)]
        elif mode == "random":
            per_input[spec.name] = [_random(spec, rng) for _ in range(count)]
        else:
            assert source is not None
            per_input[spec.name] = _from_files(spec, source, count)
    n = max(len(v) for v in per_input.values())
    return [{name: v[i % len(v)] for name, v in per_input.items()} for i in range(n)]
