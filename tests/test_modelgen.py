"""Tests for devtools.modelgen: determinism, numerics in ONNX Runtime, demo files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import numpy_helper

from devtools import modelgen

DEMO_DIR = modelgen.DEMO_DIR

# KServe datatype -> numpy dtype ONNX Runtime hands back for it.
NUMPY_DTYPES: dict[str, type] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}

BUILDERS: dict[str, Callable[[], bytes]] = {
    "simple": modelgen.simple_add_sub,
    "classifier": modelgen.classifier,
    "mlp": modelgen.mlp,
    "identity": lambda: modelgen.identity("BYTES", [2, -1]),
    "no_batch_add": modelgen.no_batch_add,
}


def session(model: bytes) -> ort.InferenceSession:
    """CPU session on one thread: small models, and tests may run in parallel."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])


def shapes(args: list[ort.NodeArg]) -> dict[str, list[object]]:
    """Name -> shape as ONNX Runtime reports it (symbolic dims as their names)."""
    return {a.name: list(a.shape) for a in args}


@pytest.mark.parametrize("name", BUILDERS)
def test_builders_are_deterministic_and_pinned(name: str) -> None:
    model = BUILDERS[name]()
    assert model == BUILDERS[name]()
    proto = onnx.load_from_string(model)
    # IR 8 / opset 17 so JetPack's older ONNX Runtime (~1.16) loads the models.
    assert proto.ir_version == 8
    assert [(o.domain, o.version) for o in proto.opset_import] == [("", 17)]
    onnx.checker.check_model(proto)


def test_seed_changes_weights() -> None:
    assert modelgen.classifier(seed=0) != modelgen.classifier(seed=1)
    assert modelgen.mlp(seed=1) != modelgen.mlp(seed=2)


def test_simple_matches_numpy() -> None:
    sess = session(modelgen.simple_add_sub())
    expected_shape = ["batch", 16]
    assert shapes(sess.get_inputs()) == {
        "INPUT0": expected_shape,
        "INPUT1": expected_shape,
    }
    assert shapes(sess.get_outputs()) == {
        "OUTPUT0": expected_shape,
        "OUTPUT1": expected_shape,
    }
    rng = np.random.default_rng(7)
    a = rng.integers(-1000, 1000, (3, 16), dtype=np.int32)
    b = rng.integers(-1000, 1000, (3, 16), dtype=np.int32)
    out0, out1 = sess.run(["OUTPUT0", "OUTPUT1"], {"INPUT0": a, "INPUT1": b})
    assert out0.dtype == np.int32 and out1.dtype == np.int32
    np.testing.assert_array_equal(out0, a + b)
    np.testing.assert_array_equal(out1, a - b)


def test_classifier_outputs_softmax_that_depends_on_the_image() -> None:
    sess = session(modelgen.classifier())
    assert shapes(sess.get_inputs()) == {"input": ["batch", 3, 224, 224]}
    assert shapes(sess.get_outputs()) == {"output": ["batch", 1000]}
    rng = np.random.default_rng(3)
    # Image-like inputs whose brightness/contrast differ per image and channel, as
    # real photos do; i.i.d. noise with equal statistics would average out in the
    # global pool and look alike to any untrained CNN.
    n = 6
    scale = rng.uniform(0.5, 2.0, (n, 1, 1, 1))
    offset = rng.standard_normal((n, 3, 1, 1))
    noise = rng.standard_normal((n, 3, 224, 224))
    images = (noise * scale + offset).astype(np.float32)
    (probs,) = sess.run(None, {"input": images})
    assert probs.shape == (n, 1000) and probs.dtype == np.float32
    assert np.isfinite(probs).all()
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
    assert (probs.max(axis=1) > 2 * probs.min(axis=1)).all()  # not uniform
    assert len(set(probs.argmax(axis=1).tolist())) > 1


def test_mlp_shape_and_numerics_match_numpy() -> None:
    model = modelgen.mlp(in_features=8, hidden=32, out_features=3, seed=5)
    sess = session(model)
    assert shapes(sess.get_inputs()) == {"input": ["batch", 8]}
    assert shapes(sess.get_outputs()) == {"output": ["batch", 3]}
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    (y,) = sess.run(None, {"input": x})
    assert y.shape == (5, 3)
    params = {
        t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(model).graph.initializer
    }
    h = x
    for i in range(3):
        h = h @ params[f"fc{i}.weight"].T + params[f"fc{i}.bias"]
        h = np.maximum(h, 0) if i < 2 else h
    np.testing.assert_allclose(y, h, rtol=1e-4, atol=1e-5)
    defaults = session(modelgen.mlp())
    assert shapes(defaults.get_inputs()) == {"input": ["batch", 256]}
    assert shapes(defaults.get_outputs()) == {"output": ["batch", 16]}


def sample(datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Distinct values of ``datatype`` so a swapped or dropped element shows up."""
    values = np.arange(int(np.prod(shape))).reshape(shape)
    if datatype == "BOOL":
        return np.asarray(values % 2 == 1)
    if datatype == "BYTES":
        return np.array([f"s{v}" for v in values.flat], dtype=object).reshape(shape)
    return values.astype(NUMPY_DTYPES[datatype])


@pytest.mark.parametrize("datatype", sorted(modelgen.DATATYPES))
def test_identity_round_trips_every_datatype(datatype: str) -> None:
    sess = session(modelgen.identity(datatype, [2, -1]))
    assert shapes(sess.get_inputs()) == {"INPUT0": ["batch", 2, "dim1"]}
    x = sample(datatype, (3, 2, 5))
    (y,) = sess.run(None, {"INPUT0": x})
    assert y.dtype == NUMPY_DTYPES[datatype]
    np.testing.assert_array_equal(y, x)


def test_identity_unbatched_keeps_fixed_dims() -> None:
    sess = session(modelgen.identity("FP32", [4], batched=False))
    assert shapes(sess.get_inputs()) == {"INPUT0": [4]}


def test_identity_rejects_unknown_datatype() -> None:
    with pytest.raises(ValueError, match="FP8"):
        modelgen.identity("FP8", [1])


def test_no_batch_add_has_fixed_shape() -> None:
    sess = session(modelgen.no_batch_add())
    assert shapes(sess.get_inputs()) == {"A": [4], "B": [4]}
    assert shapes(sess.get_outputs()) == {"SUM": [4]}
    a = np.arange(4, dtype=np.float32)
    (total,) = sess.run(None, {"A": a, "B": a * 10})
    np.testing.assert_array_equal(total, a * 11)
    # The dim is fixed, not symbolic: a different length is rejected.
    five = np.arange(5, dtype=np.float32)
    with pytest.raises(Exception, match=r"INVALID_ARGUMENT.*dimensions"):
        sess.run(None, {"A": five, "B": five})
    assert shapes(session(modelgen.no_batch_add([2, 3])).get_inputs())["A"] == [2, 3]


def test_write_model_layout(tmp_path: Path) -> None:
    folder = modelgen.write_model(tmp_path, "m", b"abc", "backend: onnxruntime\n", 3)
    assert folder == tmp_path / "m"
    assert (folder / "3" / "model.onnx").read_bytes() == b"abc"
    assert (folder / "config.yaml").read_text() == "backend: onnxruntime\n"
    bare = modelgen.write_model(tmp_path, "bare", b"xyz")
    assert sorted(p.relative_to(bare).as_posix() for p in bare.rglob("*")) == [
        "1",
        "1/model.onnx",
    ]


def test_shipped_demo_models_equal_generated_ones() -> None:
    # Also the cross-process determinism check: these files came from another run.
    # If this fails, run `python -m devtools.modelgen`; never edit them by hand.
    for name, (build, config) in modelgen.DEMO_MODELS.items():
        assert (DEMO_DIR / name / "1" / "model.onnx").read_bytes() == build(), name
        assert (DEMO_DIR / name / "config.yaml").read_bytes() == config.encode(), name
    assert (DEMO_DIR / "classifier" / "1" / "model.onnx").stat().st_size < 2_000_000


@pytest.mark.parametrize("name", ["simple", "classifier"])
def test_demo_config_matches_model_signature(name: str) -> None:
    config = yaml.safe_load(modelgen.DEMO_MODELS[name][1])
    assert config["backend"] == "onnxruntime"
    sess = session(modelgen.DEMO_MODELS[name][0]())
    # Triton dims exclude the batch dim when max_batch_size > 0.
    expected = {t["name"]: ["batch", *t["dims"]] for t in config["input"]}
    assert shapes(sess.get_inputs()) == expected
    expected = {t["name"]: ["batch", *t["dims"]] for t in config["output"]}
    assert shapes(sess.get_outputs()) == expected


def test_main_writes_demo_repository(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    modelgen.main(["--out", str(tmp_path)])
    printed = capsys.readouterr().out
    for name in modelgen.DEMO_MODELS:
        for rel in ("1/model.onnx", "config.yaml"):
            path = tmp_path / name / rel
            assert path.read_bytes() == (DEMO_DIR / name / rel).read_bytes()
            assert str(path) in printed


def test_generated_models_are_read_by_the_oldest_supported_onnx_runtime() -> None:
    """modelgen stamps an IR version and opset that the oldest ONNX Runtime this package
    allows (pyproject's lower bound) reads, per backends.model_check's measured table."""
    import re
    import sys

    from appliance.backends.model_check import READS

    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

    root = Path(__file__).resolve().parent.parent
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    (floor,) = [re.sub(r"^onnxruntime>=", "", d) for d in deps if d.startswith("onnxruntime>=")]
    oldest, max_ir, max_opset, _ = READS[0]
    assert oldest.startswith(floor + "."), (oldest, floor)
    assert max_ir >= modelgen.IR_VERSION and max_opset >= modelgen.OPSET
