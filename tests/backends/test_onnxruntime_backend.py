"""ONNX Runtime backend: execution provider selection (CPU, CUDA, TensorRT).

The selection is a pure function of the instance kind, the parameters and the
providers this ONNX Runtime build has, so it is tested everywhere; running on a
GPU provider needs onnxruntime-gpu and a GPU and is skipped elsewhere. The contract
cases every backend shares are in test_backend_conformance.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from appliance import backends
from appliance.backends.base import BackendOptions
from appliance.backends.onnxruntime_backend import select_providers
from appliance.errors import ApplianceError, Code
from devtools import modelgen

CPU_ONLY = ["CPUExecutionProvider"]
GPU_BUILD = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
CACHE = Path("/models/det/1/ort_trt_cache")


def _select(kind: str, available: list[str], **params: str) -> list[tuple[str, dict[str, str]]]:
    return select_providers(kind, params, available, "det", CACHE)


def test_kind_cpu_runs_on_the_cpu_even_in_a_gpu_build() -> None:
    assert _select("KIND_CPU", GPU_BUILD) == [("CPUExecutionProvider", {})]


def test_kind_gpu_runs_on_cuda_with_a_cpu_fallback_for_unsupported_ops() -> None:
    assert _select("KIND_GPU", GPU_BUILD, device_id="1") == [
        ("CUDAExecutionProvider", {"device_id": "1", "arena_extend_strategy": "kSameAsRequested"}),
        ("CPUExecutionProvider", {}),
    ]


def test_tensorrt_provider_caches_engines_next_to_the_model_and_takes_fp16() -> None:
    providers = _select("KIND_GPU", GPU_BUILD, execution_provider="TensorRT", precision="FP16")
    assert [name for name, _ in providers] == GPU_BUILD
    trt = providers[0][1]
    assert trt["trt_fp16_enable"] == "True"
    assert trt["trt_engine_cache_enable"] == "True"
    assert trt["trt_engine_cache_path"] == str(CACHE)


def test_kind_auto_falls_back_to_the_cpu_without_a_gpu_build() -> None:
    assert _select("KIND_AUTO", CPU_ONLY) == [("CPUExecutionProvider", {})]
    assert _select("KIND_AUTO", GPU_BUILD)[0][0] == "CUDAExecutionProvider"


@pytest.mark.parametrize(
    ("kind", "available", "params", "message"),
    [
        ("KIND_GPU", CPU_ONLY, {}, "CUDAExecutionProvider is not in this ONNX Runtime build"),
        ("KIND_GPU", CPU_ONLY, {}, "install onnxruntime-gpu in place of onnxruntime"),
        ("KIND_CPU", GPU_BUILD, {"execution_provider": "cuda"}, "kind is KIND_CPU"),
        ("KIND_GPU", GPU_BUILD, {"execution_provider": "cpu"}, "contradicts"),
        ("KIND_GPU", GPU_BUILD, {"precision": "FP16"}, "FP16 needs execution_provider: tensorrt"),
        ("KIND_GPU", GPU_BUILD, {"execution_provider": "rocm"}, "parameters.execution_provider"),
    ],
)
def test_contradictions_and_missing_providers_are_config_errors(
    kind: str, available: list[str], params: dict[str, str], message: str
) -> None:
    with pytest.raises(ApplianceError) as bad:
        _select(kind, available, **params)
    assert bad.value.code == Code.INVALID_ARG
    assert bad.value.message.startswith("model 'det': ") and message in bad.value.message


def _model(tmp_path: Path) -> Path:
    folder = tmp_path / "det" / "1"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(modelgen.mlp())
    return folder / "model.onnx"


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(), reason="this build has CUDA"
)
def test_a_gpu_model_fails_to_load_on_a_cpu_only_build(tmp_path: Path) -> None:
    path = _model(tmp_path)
    with pytest.raises(ApplianceError, match="CUDAExecutionProvider is not in this ONNX Runtime"):
        backends.create("onnxruntime", BackendOptions(path, kind="KIND_GPU"))
    auto = backends.create("onnxruntime", BackendOptions(path, kind="KIND_AUTO"))  # on the CPU
    assert auto.infer({"input": np.ones((1, 256), np.float32)}, ["output"])["output"].shape == (
        1,
        16,
    )
    auto.close()


@pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason="needs onnxruntime-gpu with the CUDA execution provider (and a GPU)",
)
def test_cuda_provider_agrees_with_the_cpu(tmp_path: Path) -> None:
    path = _model(tmp_path)
    x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    cpu = backends.create("onnxruntime", BackendOptions(path))
    gpu = backends.create("onnxruntime", BackendOptions(path, kind="KIND_GPU"))
    try:
        np.testing.assert_allclose(
            gpu.infer({"input": x}, ["output"])["output"],
            cpu.infer({"input": x}, ["output"])["output"],
            rtol=1e-3,
            atol=1e-4,
        )
    finally:
        cpu.close()
        gpu.close()


def _pool(backend: object) -> int:
    """The intra-op pool the instance's session really has."""
    session = backend._session  # type: ignore[attr-defined]
    return int(session.get_session_options().intra_op_num_threads)


def test_instances_sharing_a_session_draw_on_every_core_and_own_sessions_split(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    path.write_bytes(modelgen.identity("FP32", [-1]))
    made = []
    try:
        # two instances of one copy share a session: its pool has every core (4), so a
        # lone busy instance is not held to its half (2)
        shared = [
            backends.create(
                "onnxruntime",
                BackendOptions(path, i, 2, threads=2, shared_threads=4, share_group="copy"),
            )
            for i in range(2)
        ]
        made += shared
        assert shared[0]._session is shared[1]._session  # type: ignore[attr-defined]
        assert [_pool(b) for b in shared] == [4, 4] and [b.threads for b in shared] == [4, 4]  # type: ignore[attr-defined]
        # sessions of their own (share_session: false): each keeps its share
        own = backends.create(
            "onnxruntime",
            BackendOptions(
                path, 0, 2, threads=2, shared_threads=4, share_group="other",
                parameters={"share_session": "false"},
            ),
        )  # fmt: skip
        made.append(own)
        assert _pool(own) == 2
        # no copy to share (a worker process): its share
        alone = backends.create("onnxruntime", BackendOptions(path, threads=2))
        made.append(alone)
        assert _pool(alone) == 2
    finally:
        for b in made:
            b.close()
