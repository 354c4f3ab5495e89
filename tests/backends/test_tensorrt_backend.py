"""TensorRT backend: its decisions as pure functions (run everywhere), and on a GPU the
engine build, cache, FP16 and profile limits (skipped, with the reason, elsewhere).

The contract cases every backend shares are in test_backend_conformance.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from appliance import backends
from appliance.backends.base import BackendOptions, batch_limit, memory_usage
from appliance.backends.tensorrt_support import (
    ProfileShapes,
    TrtSettings,
    batch_limits,
    build_profile,
    check_shape,
    engine_cache_path,
    exposed_batch,
    settings,
)
from appliance.errors import ApplianceError, Code
from devtools import modelgen


def _gpu_missing() -> str | None:
    if importlib.util.find_spec("tensorrt") is None or importlib.util.find_spec("pycuda") is None:
        return "tensorrt/pycuda are not installed (pip install 'appliance[tensorrt]')"
    try:
        import pycuda.driver as cuda

        cuda.init()
        return None if cuda.Device.count() else "no NVIDIA GPU"
    except Exception as exc:
        return f"no usable NVIDIA GPU ({exc})"


NO_GPU = _gpu_missing()
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=f"needs an NVIDIA GPU: {NO_GPU}")


# ---- settings and profile limits (pure) ---------------------------------------------------


def test_settings_defaults_and_parameters() -> None:
    path = Path("/r/det/1/model.plan")
    assert settings(BackendOptions(path)) == TrtSettings("FP32", 0, 1024, 0)
    params = {
        "precision": "fp16",
        "device_id": "1",
        "workspace_mib": "256",
        "optimization_profile": "2",
    }
    assert settings(BackendOptions(path, parameters=params)) == TrtSettings("FP16", 1, 256, 2)
    with pytest.raises(ApplianceError) as bad:
        settings(BackendOptions(path, parameters={"precision": "INT4"}))
    assert bad.value.message == (
        "model 'det': parameters.precision: expected one of ['FP16', 'FP32'], got 'INT4'"
    )


def _profile(name: str, lo: int, hi: int, rest: tuple[int, ...] = (3,)) -> ProfileShapes:
    return ProfileShapes(name, (lo, *rest), (hi, *rest), (hi, *rest))


def test_batch_limits_are_what_every_input_accepts() -> None:
    declared = [("a", (-1, 3)), ("b", (-1, 3))]
    assert batch_limits(declared, [_profile("a", 1, 16), _profile("b", 2, 8)]) == (2, 8)
    # a static first dim anywhere: the engine does not batch
    assert batch_limits([("a", (-1, 3)), ("b", (4, 3))], [_profile("a", 1, 8)]) is None
    assert batch_limits([("s", ())], []) is None
    with pytest.raises(ApplianceError, match="disjoint batch ranges"):
        batch_limits(declared, [_profile("a", 1, 2), _profile("b", 4, 8)])


def test_the_config_max_batch_size_must_fit_the_profile() -> None:
    assert exposed_batch("m", None, (1, 16)) == 16  # auto-complete caps at 16
    assert exposed_batch("m", 8, (1, 16)) == 16
    assert exposed_batch("m", 0, None) == 0
    assert exposed_batch("m", None, None) == 0
    with pytest.raises(ApplianceError) as over:
        exposed_batch("m", 32, (1, 16))
    assert "max_batch_size 32 exceeds the engine's optimization profile (batch up to 16)" in str(
        over.value
    )
    with pytest.raises(ApplianceError, match="needs a batch of at least 2"):
        exposed_batch("m", 8, (2, 16))
    with pytest.raises(ApplianceError, match="static first dimension; set max_batch_size: 0"):
        exposed_batch("m", 4, None)


def test_request_shapes_are_checked_against_the_profile() -> None:
    p = ProfileShapes("x", (1, 3, 32), (8, 3, 64), (8, 3, 64))
    check_shape("m", "x", (8, 3, 40), p)
    with pytest.raises(ApplianceError) as bad:
        check_shape("m", "x", (9, 3, 40), p)
    assert bad.value.code == Code.INVALID_ARG
    assert "shape [9, 3, 40] is outside the engine's optimization profile [1..8, 3, 32..64]" in str(
        bad.value
    )
    with pytest.raises(ApplianceError):
        check_shape("m", "x", (1, 3), p)


def test_build_profile_for_onnx() -> None:
    inputs = [("img", (-1, 3, 224, 224)), ("k", (-1, 4))]
    assert build_profile("m", inputs, True, 16) == [
        ProfileShapes("img", (1, 3, 224, 224), (16, 3, 224, 224), (16, 3, 224, 224)),
        ProfileShapes("k", (1, 4), (16, 4), (16, 4)),
    ]
    assert build_profile("m", [("a", (2, 4))], False, 8) == []
    with pytest.raises(ApplianceError, match=r"dynamic dims besides the batch \(\[-1, -1\]\)"):
        build_profile("m", [("a", (-1, -1))], True, 8)
    with pytest.raises(ApplianceError, match="needs a dynamic first dimension"):
        build_profile("m", [("a", (1, 4))], True, 8)


def test_engine_cache_is_keyed_by_trt_version_gpu_options_and_model(tmp_path: Path) -> None:
    onnx_path = tmp_path / "model.onnx"
    onnx_path.write_bytes(modelgen.mlp())
    path = engine_cache_path(onnx_path, "10.3.0", "NVIDIA Jetson Orin (nvgpu)", (8, 7), "FP16", 8)
    assert path.parent == tmp_path
    name = path.name
    assert name.startswith("model.trt10.3.0.nvidia-jetson-orin-nvgpu.sm87.fp16.b8.")
    assert name.endswith(".engine")
    assert path == engine_cache_path(
        onnx_path, "10.3.0", "NVIDIA Jetson Orin (nvgpu)", (8, 7), "FP16", 8
    )
    others = {
        engine_cache_path(onnx_path, "10.4.0", "NVIDIA Jetson Orin (nvgpu)", (8, 7), "FP16", 8),
        engine_cache_path(onnx_path, "10.3.0", "NVIDIA H100", (9, 0), "FP16", 8),
        engine_cache_path(onnx_path, "10.3.0", "NVIDIA Jetson Orin (nvgpu)", (8, 7), "FP32", 8),
        engine_cache_path(onnx_path, "10.3.0", "NVIDIA Jetson Orin (nvgpu)", (8, 7), "FP16", 16),
    }
    assert path not in others and len(others) == 4
    onnx_path.write_bytes(modelgen.mlp(seed=2))  # a changed model is rebuilt, never served stale
    assert (
        engine_cache_path(onnx_path, "10.3.0", "NVIDIA Jetson Orin (nvgpu)", (8, 7), "FP16", 8)
        != path
    )


def test_missing_tensorrt_fails_the_load_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "det" / "1"
    folder.mkdir(parents=True)
    (folder / "model.plan").write_bytes(b"not an engine")
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # as on a machine without it
    monkeypatch.delitem(sys.modules, "appliance.backends.tensorrt_backend", raising=False)
    with pytest.raises(ApplianceError) as bad:
        backends.create("tensorrt", BackendOptions(folder / "model.plan"))
    assert bad.value.code == Code.INVALID_ARG
    assert "backend 'tensorrt' needs a package that is not installed" in bad.value.message
    assert "pip install 'appliance[tensorrt]'" in bad.value.message


def test_model_files_choose_the_backend() -> None:
    assert backends.backend_for_file(Path("model.plan")) == "tensorrt"
    assert backends.backend_for_file(Path("model.engine")) == "tensorrt"
    assert backends.backend_for_file(Path("model.xml")) == "openvino"
    assert backends.backend_for_file(Path("model.bin")) is None  # IR weights, not a model
    assert backends.PLATFORMS["tensorrt_plan"] == "tensorrt"


# ---- on a GPU ---------------------------------------------------------------------------


def _onnx(tmp_path: Path, data: bytes) -> Path:
    folder = tmp_path / "m" / "1"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(data)
    return folder / "model.onnx"


@needs_gpu
def test_engine_is_built_once_cached_and_limited_by_its_profile(tmp_path: Path) -> None:
    path = _onnx(tmp_path, modelgen.mlp())
    b = backends.create("tensorrt", BackendOptions(path, max_batch_size=4))
    try:
        assert batch_limit(b) == 4
        usage = memory_usage(b)
        assert usage is not None and usage.gpu_bytes > 0
        x = np.ones((4, 256), np.float32)
        assert b.infer({"input": x}, ["output"])["output"].shape == (4, 16)
        with pytest.raises(ApplianceError, match="outside the engine's optimization profile"):
            b.infer({"input": np.ones((5, 256), np.float32)}, ["output"])
    finally:
        b.close()
    cached = list(path.parent.glob("model.trt*.engine"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    backends.create("tensorrt", BackendOptions(path, max_batch_size=4)).close()
    assert cached[0].stat().st_mtime_ns == stamp  # read from the cache, not rebuilt
    # the cached engine as a plan: a config asking for more than its profile is refused
    plan = path.with_name("model.plan")
    plan.write_bytes(cached[0].read_bytes())
    with pytest.raises(ApplianceError, match="exceeds the engine's optimization profile"):
        backends.create("tensorrt", BackendOptions(plan, max_batch_size=8))


@needs_gpu
def test_fp16_engine_agrees_with_onnx_runtime_loosely(tmp_path: Path) -> None:
    path = _onnx(tmp_path, modelgen.classifier())
    x = np.random.default_rng(0).standard_normal((2, 3, 224, 224)).astype(np.float32)
    ref = backends.create("onnxruntime", BackendOptions(path))
    want = ref.infer({"input": x}, ["output"])["output"]
    ref.close()
    b = backends.create("tensorrt", BackendOptions(path, parameters={"precision": "FP16"}))
    try:
        got = b.infer({"input": x}, ["output"])["output"]
    finally:
        b.close()
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=1e-4)


def test_auto_complete_is_capped_by_the_engine_batch_limit() -> None:
    class Limited:
        max_batch_size = 4

    class Unlimited:
        pass

    assert backends.auto_max_batch_size(Limited(), 8) == 4
    assert backends.auto_max_batch_size(Limited(), 2) == 2
    assert backends.auto_max_batch_size(Unlimited(), 8) == 8
    Limited.max_batch_size = 0  # an engine that does not batch leaves the default alone
    assert backends.auto_max_batch_size(Limited(), 8) == 8


# ---- the backend's own Python against a stand-in of the tensorrt / pycuda API ----------
#
# Not TensorRT: a fake engine ("OUT = IN + 1", described by JSON in model.plan) behind the
# same names the backend calls, so that its buffer handling, profile limits, sharing and
# close run on every machine. Whether real TensorRT behaves as assumed is what the GPU
# cases above and benchmarks/gpu_check.sh check.


class _FakeCuda(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("pycuda.driver")
        self.memory: dict[int, bytearray] = {}
        self.pushed = 0
        fake = self

        class Context:
            def push(self) -> None:
                fake.pushed += 1

            def pop(self) -> None:
                fake.pushed -= 1

            def detach(self) -> None:
                pass

        class Device:
            def __init__(self, index: int) -> None:
                pass

            @staticmethod
            def count() -> int:
                return 1

            def retain_primary_context(self) -> Context:
                return Context()

        class Allocation:
            def __init__(self, nbytes: int) -> None:
                self.key = 1000 + len(fake.memory)
                fake.memory[self.key] = bytearray(nbytes)

            def __int__(self) -> int:
                return self.key

            def free(self) -> None:
                del fake.memory[self.key]

        class Stream:
            handle = 7

            def synchronize(self) -> None:
                pass

        self.Device, self.Stream, self.mem_alloc = Device, Stream, Allocation
        self.init = lambda: None
        self.pagelocked_empty = lambda n, dtype: np.empty(n, dtype)

        def htod(dev: Allocation, host: np.ndarray, stream: Stream) -> None:
            raw = np.ascontiguousarray(host).tobytes()
            fake.memory[dev.key][: len(raw)] = raw

        def dtoh(host: np.ndarray, dev: Allocation, stream: Stream) -> None:
            host[:] = np.frombuffer(bytes(fake.memory[dev.key][: host.nbytes]), host.dtype)

        self.memcpy_htod_async, self.memcpy_dtoh_async = htod, dtoh


def _fake_tensorrt(cuda: _FakeCuda) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.0.fake"  # type: ignore[attr-defined]
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})  # type: ignore[attr-defined]
    trt.TensorIOMode = types.SimpleNamespace(INPUT="in", OUTPUT="out")  # type: ignore[attr-defined]
    trt.nptype = lambda dtype: np.float32  # type: ignore[attr-defined]

    class Context:
        def __init__(self, engine: Engine) -> None:
            self.engine, self.shapes, self.addresses = engine, {}, {}

        def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
            self.shapes[name] = tuple(shape)
            return True

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            return self.shapes.get(name, self.shapes["IN"])

        def set_tensor_address(self, name: str, address: int) -> None:
            self.addresses[name] = address

        def execute_async_v3(self, stream: int) -> bool:
            n = int(np.prod(self.shapes["IN"])) * 4
            x = np.frombuffer(bytes(cuda.memory[self.addresses["IN"]][:n]), np.float32)
            cuda.memory[self.addresses["OUT"]][:n] = (x + 1).tobytes()
            return True

    class Engine:
        def __init__(self, spec: dict[str, int]) -> None:
            self.lo, self.hi, self.width = spec["min"], spec["max"], spec["width"]
            self.num_io_tensors, self.num_optimization_profiles = 2, 1
            self.device_memory_size_v2 = 4096

        def get_tensor_name(self, i: int) -> str:
            return ["IN", "OUT"][i]

        def get_tensor_mode(self, name: str) -> str:
            return "in" if name == "IN" else "out"

        def get_tensor_dtype(self, name: str) -> types.SimpleNamespace:
            return types.SimpleNamespace(name="FLOAT")

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            return (-1, self.width)

        def get_tensor_profile_shape(self, name: str, profile: int) -> list[tuple[int, ...]]:
            return [(self.lo, self.width), (self.hi, self.width), (self.hi, self.width)]

        def create_execution_context(self) -> Context:
            return Context(self)

    class Runtime:
        def __init__(self, logger: object) -> None:
            pass

        def deserialize_cuda_engine(self, data: bytes) -> Engine:
            return Engine(json.loads(data))

    trt.Runtime = Runtime  # type: ignore[attr-defined]
    return trt


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> _FakeCuda:
    cuda = _FakeCuda()
    pycuda = types.ModuleType("pycuda")
    pycuda.driver = cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pycuda", pycuda)
    monkeypatch.setitem(sys.modules, "pycuda.driver", cuda)
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt(cuda))
    monkeypatch.delitem(sys.modules, "appliance.backends.tensorrt_backend", raising=False)
    return cuda


def _plan(tmp_path: Path, lo: int = 1, hi: int = 8) -> Path:
    folder = tmp_path / "det" / "1"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.plan").write_text(json.dumps({"min": lo, "max": hi, "width": 3}))
    return folder / "model.plan"


def test_buffers_are_reused_across_batch_sizes_and_freed_on_close(
    tmp_path: Path, fake_gpu: _FakeCuda
) -> None:
    path = _plan(tmp_path)
    options = BackendOptions(path, instance_count=2, share_group="det:1:a")
    a = backends.create("tensorrt", options)
    b = backends.create("tensorrt", options)
    try:
        assert a.inputs[0].shape == (-1, 3) and batch_limit(a) == 8
        allocations = len(fake_gpu.memory)
        assert allocations == 4  # an input and an output buffer per instance, made at load
        for rows in (8, 1, 5, 2):  # shrinking and growing batches: no stale rows leak
            x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
            out = a.infer({"IN": x}, ["OUT"])["OUT"]
            np.testing.assert_array_equal(out, x + 1)
            assert out.shape == (rows, 3)
        kept = a.infer({"IN": np.zeros((2, 3), np.float32)}, ["OUT"])["OUT"]
        b.infer({"IN": np.full((2, 3), 9, np.float32)}, ["OUT"])
        a.infer({"IN": np.full((2, 3), 5, np.float32)}, ["OUT"])
        np.testing.assert_array_equal(kept, 1)  # results are copies, not the reused buffer
        assert len(fake_gpu.memory) == allocations
        with pytest.raises(ApplianceError, match=r"outside the engine's optimization profile"):
            a.infer({"IN": np.zeros((9, 3), np.float32)}, ["OUT"])
        usage = memory_usage(a)
        other = memory_usage(b)
        assert usage is not None and other is not None
        # the engine is charged once: to the instance that loaded it
        assert usage.gpu_bytes - other.gpu_bytes == path.stat().st_size
    finally:
        a.close()
        b.close()
        a.close()  # a second close is harmless
    assert fake_gpu.memory == {} and fake_gpu.pushed == 0


def test_profile_limits_refuse_a_bigger_max_batch_size(tmp_path: Path, fake_gpu: _FakeCuda) -> None:
    with pytest.raises(ApplianceError, match="max_batch_size 16 exceeds"):
        backends.create("tensorrt", BackendOptions(_plan(tmp_path), max_batch_size=16))
    assert fake_gpu.memory == {} and fake_gpu.pushed == 0  # a failed load frees what it made
    with pytest.raises(ApplianceError, match="needs a batch of at least 2"):
        backends.create("tensorrt", BackendOptions(_plan(tmp_path, lo=2), max_batch_size=4))
