"""One backend contract: every available backend runs the same cases.

The cases: every datatype the backend serves (the others are refused at load, not
mangled), a dynamic batch dimension, several inputs and outputs, INVALID_ARG for
wrong inputs, two instances inferring at once on their own threads, memory given
back on close, and numerical agreement with ONNX Runtime on the CPU (the reference)
within a stated tolerance.

ONNX Runtime always runs; OpenVINO runs where its wheel is installed (the test
extra installs it); TensorRT runs only where ``tensorrt``, ``pycuda`` and an NVIDIA
GPU are present, and is skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from appliance import backends, datatypes
from appliance.backends.base import Backend, BackendOptions, TensorSpec
from appliance.core.instances import InstanceGroup
from appliance.errors import ApplianceError, Code
from devtools import modelgen


def _unavailable(name: str) -> str | None:
    """Why backend ``name`` can't run here, or None."""
    if name == "openvino" and importlib.util.find_spec("openvino") is None:
        return f"openvino is not installed ({backends.install_hint('openvino')})"
    if name == "tensorrt":
        if (
            importlib.util.find_spec("tensorrt") is None
            or importlib.util.find_spec("pycuda") is None
        ):
            return f"tensorrt/pycuda are not installed ({backends.install_hint('tensorrt')})"
        try:
            import pycuda.driver as cuda

            cuda.init()
            if cuda.Device.count() == 0:
                return "no NVIDIA GPU"
        except Exception as exc:  # no driver, no device
            return f"no usable NVIDIA GPU ({exc})"
    return None


ALL = ("onnxruntime", "openvino", "tensorrt")
REFERENCE = "onnxruntime"
BACKENDS = [
    pytest.param(n, marks=pytest.mark.skipif(bool(_unavailable(n)), reason=str(_unavailable(n))))
    for n in ALL
]
# datatypes each backend serves; a model with any other is refused at load
SERVES = {
    "onnxruntime": set(datatypes.DATATYPES),
    # OpenVINO: no BYTES (see appliance/backends/openvino_backend.py)
    "openvino": set(datatypes.DATATYPES) - {"BYTES"},
    # TensorRT's I/O types (unverified here: no GPU on CI)
    "tensorrt": {"BOOL", "UINT8", "INT32", "INT64", "FP16", "FP32"},
}
# value ranges a backend limits a datatype to: values outside are refused per request
RANGES = {("openvino", "INT64"): (int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max))}
# agreement with the reference, as (rtol, atol) for np.testing.assert_allclose. Same
# FP32 math in a different kernel order: OpenVINO ~1e-6 relative; TensorRT (TF32 off,
# other conv algorithms) looser.
TOLERANCE = {"openvino": (1e-4, 1e-6), "tensorrt": (1e-3, 1e-5)}

Open = Callable[..., Backend]


@pytest.fixture
def open_backend(tmp_path: Path) -> Iterator[Open]:
    """``open_backend(name, model_bytes, **options)``: write the model as
    ``<tmp>/<model>/1/model.onnx``, create one instance, close it at teardown."""
    made: list[Backend] = []
    count = 0

    def make(name: str, model: bytes, model_name: str = "m", **options: Any) -> Backend:
        nonlocal count
        count += 1
        folder = tmp_path / f"{count}" / model_name / "1"
        folder.mkdir(parents=True)
        (folder / "model.onnx").write_bytes(model)
        backend = backends.create(name, BackendOptions(folder / "model.onnx", **options))
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def _sample(
    datatype: str, shape: tuple[int, ...], limits: tuple[int, int] | None = None
) -> np.ndarray:
    """Values that catch truncation and conversion: extremes, negatives, fractions."""
    n = int(np.prod(shape))
    if datatype == "BYTES":
        words = [b"", b"a", "\u00e9t\u00e9".encode(), b"x" * 40, b"0", b"\x7f"]
        return np.array([words[i % len(words)] for i in range(n)], dtype=object).reshape(shape)
    dtype = datatypes.to_numpy_dtype(datatype)
    if datatype == "BOOL":
        return (np.arange(n) % 3 == 0).reshape(shape)
    if dtype.kind in "iu":
        lo, hi = limits or (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
        values = [lo, hi, 0, 1, hi // 3, lo // 5 if lo else 7]
        return np.array([values[i % len(values)] for i in range(n)], dtype=dtype).reshape(shape)
    return (np.arange(n, dtype=np.float64) * -1.37 + 0.25).astype(dtype).reshape(shape)


def _as_bytes(arr: np.ndarray) -> list[bytes]:
    return [x.encode() if isinstance(x, str) else bytes(x) for x in arr.ravel()]


@pytest.mark.parametrize("datatype", datatypes.DATATYPES)
@pytest.mark.parametrize("name", BACKENDS)
def test_every_datatype_round_trips_or_is_refused_at_load(
    name: str, datatype: str, open_backend: Open
) -> None:
    model = modelgen.identity(datatype, [3])
    if datatype not in SERVES[name]:
        with pytest.raises(ApplianceError) as refused:
            open_backend(name, model, model_name="ident")
        assert refused.value.code == Code.INVALID_ARG
        assert "'ident'" in refused.value.message and "INPUT0" in refused.value.message
        return
    b = open_backend(name, model, model_name="ident")
    assert b.inputs == [TensorSpec("INPUT0", datatype, (-1, 3))]
    assert b.outputs == [TensorSpec("OUTPUT0", datatype, (-1, 3))]
    limits = RANGES.get((name, datatype))
    if limits is not None:  # beyond the range: refused, never truncated
        beyond = np.full((1, 3), limits[1], dtype=datatypes.to_numpy_dtype(datatype)) + 1
        with pytest.raises(ApplianceError) as refused:
            b.infer({"INPUT0": beyond}, ["OUTPUT0"])
        assert refused.value.code == Code.INVALID_ARG and "INPUT0" in refused.value.message
    x = _sample(datatype, (2, 3), limits)
    out = b.infer({"INPUT0": x}, ["OUTPUT0"])["OUTPUT0"]
    assert out.shape == (2, 3)
    if datatype == "BYTES":
        assert _as_bytes(out) == _as_bytes(x)
    else:
        assert out.dtype == x.dtype
        np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("name", BACKENDS)
def test_dynamic_batch_rows_are_independent(name: str, open_backend: Open) -> None:
    b = open_backend(name, modelgen.mlp())
    assert b.inputs == [TensorSpec("input", "FP32", (-1, 256))]
    assert b.outputs == [TensorSpec("output", "FP32", (-1, 16))]
    rows = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32)
    alone = np.concatenate(
        [b.infer({"input": rows[i : i + 1]}, ["output"])["output"] for i in range(8)]
    )
    for n in (1, 3, 8):
        out = b.infer({"input": rows[:n]}, ["output"])["output"]
        assert out.shape == (n, 16) and out.dtype == np.float32
        np.testing.assert_allclose(out, alone[:n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_several_inputs_and_outputs(name: str, open_backend: Open) -> None:
    b = open_backend(name, modelgen.simple_add_sub())
    assert [s.name for s in b.inputs] == ["INPUT0", "INPUT1"]
    assert [s.name for s in b.outputs] == ["OUTPUT0", "OUTPUT1"]
    a = np.arange(48, dtype=np.int32).reshape(3, 16)
    c = np.full((3, 16), 5, dtype=np.int32)
    both = b.infer({"INPUT0": a, "INPUT1": c}, ["OUTPUT0", "OUTPUT1"])
    np.testing.assert_array_equal(both["OUTPUT0"], a + c)
    np.testing.assert_array_equal(both["OUTPUT1"], a - c)
    only = b.infer({"INPUT0": a, "INPUT1": c}, ["OUTPUT1"])
    assert list(only) == ["OUTPUT1"]
    np.testing.assert_array_equal(only["OUTPUT1"], a - c)
    # a non-contiguous view is read by value, not by its memory layout
    wide = np.arange(96, dtype=np.int32).reshape(3, 32)[:, ::2]
    np.testing.assert_array_equal(
        b.infer({"INPUT0": wide, "INPUT1": c}, ["OUTPUT0"])["OUTPUT0"], wide + c
    )


@pytest.mark.parametrize("name", BACKENDS)
def test_wrong_inputs_are_invalid_arg_and_leave_the_instance_usable(
    name: str, open_backend: Open
) -> None:
    b = open_backend(name, modelgen.simple_add_sub(), model_name="simple")
    a = np.ones((2, 16), np.int32)
    cases: list[tuple[dict[str, np.ndarray], list[str], str]] = [
        ({"INPUT0": a}, ["OUTPUT0"], "INPUT1"),  # missing
        ({"INPUT0": a, "INPUT1": a, "EXTRA": a}, ["OUTPUT0"], "EXTRA"),  # unknown
        ({"INPUT0": a.astype(np.float32), "INPUT1": a}, ["OUTPUT0"], "FP32"),  # datatype
        ({"INPUT0": a[0], "INPUT1": a}, ["OUTPUT0"], "INPUT0"),  # rank
        ({"INPUT0": np.ones((2, 15), np.int32), "INPUT1": a}, ["OUTPUT0"], "[2, 15]"),  # dim
        ({"INPUT0": a, "INPUT1": a}, ["NOPE"], "NOPE"),  # unknown output
    ]
    for inputs, outputs, mentioned in cases:
        with pytest.raises(ApplianceError) as bad:
            b.infer(inputs, outputs)
        assert bad.value.code == Code.INVALID_ARG
        assert mentioned in bad.value.message and "simple" in bad.value.message
    out = b.infer({"INPUT0": a, "INPUT1": 2 * a}, ["OUTPUT0"])
    np.testing.assert_array_equal(out["OUTPUT0"], 3 * a)


@pytest.mark.parametrize("name", BACKENDS)
def test_two_instances_infer_at_once_on_their_own_threads(name: str, tmp_path: Path) -> None:
    folder = tmp_path / "mlp" / "1"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(modelgen.mlp())
    reference = backends.create(REFERENCE, BackendOptions(folder / "model.onnx"))
    rng = np.random.default_rng(7)
    batches = [rng.standard_normal((1 + i % 4, 256)).astype(np.float32) for i in range(40)]
    expected = [reference.infer({"input": x}, ["output"])["output"] for x in batches]
    reference.close()

    def factory(index: int) -> Backend:
        options = BackendOptions(
            folder / "model.onnx",
            instance_index=index,
            instance_count=2,
            threads=1,
            share_group="mlp:1:test",
        )
        return backends.create(name, options)

    async def main() -> None:
        group = await InstanceGroup.create("mlp", 2, factory)
        try:

            async def drive(k: int) -> None:
                instance = group.instances[k]
                for i in range(k, len(batches), 2):
                    out = await instance.run(
                        lambda b, x: b.infer({"input": x}, ["output"]), batches[i]
                    )
                    np.testing.assert_allclose(out["output"], expected[i], rtol=1e-4, atol=1e-5)

            await asyncio.wait_for(asyncio.gather(drive(0), drive(1)), 60)
        finally:
            await group.close()

    asyncio.run(main())


def _trim() -> None:
    """Hand freed heap pages back to the OS (glibc), so RSS shows what was freed."""
    gc.collect()
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("name", BACKENDS)
def test_close_gives_the_memory_back(name: str, tmp_path: Path) -> None:
    """Load a ~84 MiB model, close it: RSS (GPU memory for TensorRT) grows by at
    least half the weights while loaded and is back within a quarter of them after."""
    folder = tmp_path / "big" / "1"
    folder.mkdir(parents=True)
    path = folder / "model.onnx"
    path.write_bytes(modelgen.mlp(in_features=1024, hidden=4096, out_features=16))
    weights = (1024 * 4096 + 4096 * 4096 + 4096 * 16) * 4
    x = np.ones((2, 1024), np.float32)
    probe = _rss
    if name == "tensorrt":
        import pycuda.driver as cuda

        def probe() -> int:
            free, total = cuda.mem_get_info()
            return int(total - free)

    def cycle() -> tuple[int, int]:
        b = backends.create(name, BackendOptions(path, threads=1))
        b.infer({"input": x}, ["output"])
        _trim()
        loaded = probe()
        b.close()
        del b
        _trim()
        return loaded, probe()

    cycle()  # the engine's one-time costs: libraries, thread pools, allocator arenas
    before = probe()
    loaded, after = cycle()
    assert loaded - before > weights // 2, (before, loaded)
    assert after - before < weights // 4, (before, loaded, after)


MODELS = {"mlp": (modelgen.mlp, (4, 256)), "classifier": (modelgen.classifier, (2, 3, 224, 224))}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("name", [p for p in BACKENDS if p.values[0] != REFERENCE])
def test_agrees_with_onnx_runtime_within_tolerance(
    name: str, model: str, open_backend: Open
) -> None:
    build, shape = MODELS[model]
    data = build()
    x = np.random.default_rng(11).standard_normal(shape).astype(np.float32)
    want = open_backend(REFERENCE, data).infer({"input": x}, ["output"])["output"]
    got = open_backend(name, data).infer({"input": x}, ["output"])["output"]
    rtol, atol = TOLERANCE[name]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()
