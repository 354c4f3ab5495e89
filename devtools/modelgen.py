"""Deterministic builders of small, real ONNX models for tests, benchmarks and demos.

Every builder returns serialized ``ModelProto`` bytes that are identical across
runs (weights come from ``numpy.random.default_rng(seed)``), so the shipped
``demo_models`` folder can be checked against a fresh build.

This module is dev/test tooling only: ``onnx`` is a test extra, not a runtime
dependency, so nothing else in ``appliance`` may import it at runtime.

Regenerate the demo repository with ``python -m devtools.modelgen [--out DIR]``.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
# ONNX Runtime 1.16 (JetPack) rejects models newer than IR 9; pin IR 8 so the
# same files load on the edge boxes as on a current desktop runtime.
IR_VERSION = 8
# Fixed producer metadata (no onnx version string) keeps the bytes stable when
# the onnx package is upgraded.
PRODUCER = "appliance.modelgen"
BATCH = "batch"

# KServe / Triton datatype name -> ONNX element type.
DATATYPES: dict[str, int] = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}

SIMPLE_CONFIG = """\
# Triton's classic "simple" example: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1
backend: onnxruntime
max_batch_size: 8
input:
  - {name: INPUT0, data_type: TYPE_INT32, dims: [16]}
  - {name: INPUT1, data_type: TYPE_INT32, dims: [16]}
output:
  - {name: OUTPUT0, data_type: TYPE_INT32, dims: [16]}
  - {name: OUTPUT1, data_type: TYPE_INT32, dims: [16]}
dynamic_batching:
  max_queue_delay_microseconds: 100
instance_group:
  - {count: 1, kind: KIND_CPU}
"""

CLASSIFIER_CONFIG = """\
# Image-classifier-shaped CNN with deterministic weights (demo only, not trained)
backend: onnxruntime
max_batch_size: 32
input:
  - {name: input, data_type: TYPE_FP32, format: FORMAT_NCHW, dims: [3, 224, 224]}
output:
  - {name: output, data_type: TYPE_FP32, dims: [1000]}
dynamic_batching:
  preferred_batch_size: [8, 16, 32]
  max_queue_delay_microseconds: 2000
  default_queue_policy: {max_queue_size: 128}
instance_group:
  - {count: 1, kind: KIND_CPU}
"""


def _io(names: Sequence[str], elem: int, shape: list[str | int]) -> list[onnx.ValueInfoProto]:
    """Graph inputs/outputs sharing one element type and shape."""
    return [helper.make_tensor_value_info(n, elem, shape) for n in names]


def _shape(dims: Sequence[int], batched: bool) -> list[str | int]:
    """Leading symbolic ``batch`` when batched; each -1 becomes a named symbolic dim."""
    shape: list[str | int] = [BATCH] if batched else []
    # Same names on inputs and outputs tell the runtime those dims are equal.
    return shape + [f"dim{i}" if d == -1 else int(d) for i, d in enumerate(dims)]


def _param(
    name: str, rng: np.random.Generator, shape: tuple[int, ...], std: float
) -> onnx.TensorProto:
    """Normal(0, std) FP32 initializer (stored as little-endian raw_data)."""
    array = (rng.standard_normal(shape) * std).astype(np.float32)
    return numpy_helper.from_array(array, name=name)


def _finish(
    name: str,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializer: Sequence[onnx.TensorProto] = (),
) -> bytes:
    """Build a checked model with pinned opset/IR version and serialize it."""
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializer))
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name=PRODUCER
    )
    # make_model stamps the *installed* onnx's IR version; pin it afterwards.
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    serialized: bytes = model.SerializeToString()
    return serialized


def simple_add_sub() -> bytes:
    """Triton's "simple": OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1.

    All four tensors are INT32 [batch, 16].
    """
    shape = _shape([16], batched=True)
    nodes = [
        helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"], name="add"),
        helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"], name="sub"),
    ]
    return _finish(
        "simple",
        nodes,
        _io(["INPUT0", "INPUT1"], TensorProto.INT32, shape),
        _io(["OUTPUT0", "OUTPUT1"], TensorProto.INT32, shape),
    )


def classifier(seed: int = 0) -> bytes:
    """Untrained image-classifier-shaped CNN with softmax output.

    "input" FP32 [batch,3,224,224] -> four stride-2 3x3 Conv+Relu (3->16->32->64->128)
    -> GlobalAveragePool -> Flatten -> Gemm 128->1000 -> Softmax(axis=1) -> "output"
    FP32 [batch,1000]. He-initialised weights keep activations from collapsing to
    zero, so the softmax is not uniform and its argmax depends on the image.
    """
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    x = "input"
    for i, (cin, cout) in enumerate(itertools.pairwise([3, 16, 32, 64, 128])):
        w, b, y = f"conv{i}.weight", f"conv{i}.bias", f"conv{i}"
        # He init for ReLU (fan_in = cin*3*3); small random biases rather than zeros
        # so no initializer is trivially constant.
        inits += [_param(w, rng, (cout, cin, 3, 3), np.sqrt(2.0 / (cin * 9)))]
        inits += [_param(b, rng, (cout,), 0.1)]
        nodes.append(
            helper.make_node(
                "Conv",
                [x, w, b],
                [y],
                name=y,
                kernel_shape=[3, 3],
                strides=[2, 2],
                pads=[1, 1, 1, 1],
            )
        )
        nodes.append(helper.make_node("Relu", [y], [f"relu{i}"], name=f"relu{i}"))
        x = f"relu{i}"
    # fc weight is [out, in] (PyTorch layout), hence transB=1.
    inits += [_param("fc.weight", rng, (1000, 128), np.sqrt(2.0 / 128))]
    inits += [_param("fc.bias", rng, (1000,), 0.1)]
    nodes += [
        helper.make_node("GlobalAveragePool", [x], ["pool"], name="pool"),
        helper.make_node("Flatten", ["pool"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1),
        helper.make_node("Softmax", ["logits"], ["output"], name="softmax", axis=1),
    ]
    return _finish(
        "classifier",
        nodes,
        _io(["input"], TensorProto.FLOAT, _shape([3, 224, 224], batched=True)),
        _io(["output"], TensorProto.FLOAT, _shape([1000], batched=True)),
        inits,
    )


def mlp(
    in_features: int = 256,
    hidden: int = 512,
    out_features: int = 16,
    seed: int = 1,
    retrained: tuple[int, int] | None = None,
) -> bytes:
    """Three-layer MLP: "input" FP32 [batch,in] -> "output" FP32 [batch,out].

    Gemm+Relu -> Gemm+Relu -> Gemm, He-initialised. ``retrained=(layer, seed)``: the
    same model as ``seed`` gives except layer ``layer`` (0-2), drawn from that other
    seed: a fine-tune that retrained one layer (what a delta update ships).
    """
    rng = np.random.default_rng(seed)
    sizes = [in_features, hidden, hidden, out_features]
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    x = "input"
    for i, (fin, fout) in enumerate(itertools.pairwise(sizes)):
        w, b = f"fc{i}.weight", f"fc{i}.bias"
        layer = [_param(w, rng, (fout, fin), np.sqrt(2.0 / fin)), _param(b, rng, (fout,), 0.1)]
        if retrained is not None and retrained[0] == i:
            other = np.random.default_rng(retrained[1])
            layer = [_param(w, other, (fout, fin), np.sqrt(2.0 / fin))]
            layer += [_param(b, other, (fout,), 0.1)]
        inits += layer
        last = i == len(sizes) - 2
        y = "output" if last else f"fc{i}"
        nodes.append(helper.make_node("Gemm", [x, w, b], [y], name=y, transB=1))
        if not last:
            nodes.append(helper.make_node("Relu", [y], [f"relu{i}"], name=f"relu{i}"))
            x = f"relu{i}"
    return _finish(
        "mlp",
        nodes,
        _io(["input"], TensorProto.FLOAT, _shape([in_features], batched=True)),
        _io(["output"], TensorProto.FLOAT, _shape([out_features], batched=True)),
        inits,
    )


def identity(datatype: str, dims: list[int], batched: bool = True) -> bytes:
    """Identity "INPUT0" -> "OUTPUT0" for one KServe datatype name (BYTES -> STRING).

    When ``batched`` the first dim is symbolic ``batch`` followed by ``dims``;
    a -1 in ``dims`` is a symbolic dim as well. Unknown names raise ValueError.
    """
    if datatype not in DATATYPES:
        raise ValueError(f"unknown datatype {datatype!r}; expected one of {list(DATATYPES)}")
    shape = _shape(dims, batched)
    return _finish(
        f"identity_{datatype.lower()}",
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"], name="identity")],
        _io(["INPUT0"], DATATYPES[datatype], shape),
        _io(["OUTPUT0"], DATATYPES[datatype], shape),
    )


def no_batch_add(dims: Sequence[int] = (4,)) -> bytes:
    """FP32 "SUM" = "A" + "B" with a fixed shape and no batch dim.

    For testing config auto-complete of a model that must get max_batch_size 0.
    """
    shape = _shape(dims, batched=False)
    return _finish(
        "no_batch_add",
        [helper.make_node("Add", ["A", "B"], ["SUM"], name="add")],
        _io(["A", "B"], TensorProto.FLOAT, shape),
        _io(["SUM"], TensorProto.FLOAT, shape),
    )


def accumulator(batched: bool = True) -> bytes:
    """A stateful model for the sequence batcher: INT32 "INPUT" [batch, 1] is added
    to the implicit state "STATE_IN" and returned as "OUTPUT"; "STATE_OUT" (the
    same sum) becomes the next request's "STATE_IN". "READY" (INT32 [batch, 1],
    a control input) zeroes the rows of slots with nothing ready.
    """
    shape = _shape([1], batched)
    nodes = [
        helper.make_node("Add", ["INPUT", "STATE_IN"], ["sum"], name="add"),
        helper.make_node("Mul", ["sum", "READY"], ["OUTPUT"], name="ready"),
        helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"], name="state"),
    ]
    return _finish(
        "accumulator",
        nodes,
        _io(["INPUT", "STATE_IN", "READY"], TensorProto.INT32, shape),
        _io(["OUTPUT", "STATE_OUT"], TensorProto.INT32, shape),
    )


def frame_mean() -> bytes:
    """A camera-frame stand-in: UINT8 "frame" [batch, H, W, 3] -> FP32 "mean" [batch, 3].

    Casts and averages over height and width, so the cost is one pass over the frame:
    small next to moving a 1080p frame, which is what the camera benchmark measures.
    """
    frame = helper.make_tensor_value_info("frame", TensorProto.UINT8, [BATCH, "h", "w", 3])
    mean = helper.make_tensor_value_info("mean", TensorProto.FLOAT, [BATCH, 3])
    nodes = [
        helper.make_node("Cast", ["frame"], ["pixels"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("ReduceMean", ["pixels"], ["mean"], axes=[1, 2], keepdims=0, name="mean"),
    ]
    return _finish("frame_mean", nodes, [frame], [mean])


def inlined_if() -> bytes:
    """FP32 "input" [batch, 4] -> "output" [batch, 1]: an ``If`` on a constant condition
    (row mean, else row max), as exporters leave them. OpenVINO inlines the taken branch
    and its compiled output then also answers to the branch's internal tensor name,
    which sorts before "output" (``If_0_then_branch/ReduceMean_output_0``)."""

    def branch(name: str, op: str) -> onnx.GraphProto:
        out = f"{name}/{op}_output_0"
        node = helper.make_node(op, ["input"], [out], axes=[1], keepdims=1, name=f"{name}/{op}")
        value = helper.make_tensor_value_info(out, TensorProto.FLOAT, [BATCH, 1])
        return helper.make_graph([node], name, [], [value])

    condition = helper.make_tensor("condition", TensorProto.BOOL, [], [True])
    nodes = [
        helper.make_node("Constant", [], ["condition"], value=condition, name="condition"),
        helper.make_node(
            "If",
            ["condition"],
            ["output"],
            then_branch=branch("If_0_then_branch", "ReduceMean"),
            else_branch=branch("If_0_else_branch", "ReduceMax"),
            name="If_0",
        ),
    ]
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [BATCH, 4])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [BATCH, 1])
    return _finish("inlined_if", nodes, [x], [y])


def write_model(
    repo: Path, name: str, model: bytes, config: str | None = None, version: int = 1
) -> Path:
    """Write one model into a repository and return its folder ``repo/name``.

    Writes ``repo/name/<version>/model.onnx`` and, when ``config`` (YAML text) is
    given, ``repo/name/config.yaml``.
    """
    folder = Path(repo) / name
    version_dir = folder / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    (version_dir / "model.onnx").write_bytes(model)
    if config is not None:
        # newline="\n" so the file is byte-identical on Windows checkouts too.
        with open(folder / "config.yaml", "w", encoding="utf-8", newline="\n") as f:
            f.write(config)
    return folder


# the shipped demo classifier also names class labels (Triton's label_filename, for
# "score:index:label" classification, as Triton's image_client prints); its labels.txt
# is written next to it by write_demo_repository
CLASSIFIER_LABELS = "".join(f"class_{i}\n" for i in range(1000))
CLASSIFIER_DEMO_CONFIG = CLASSIFIER_CONFIG.replace(
    "dims: [1000]}", "dims: [1000], label_filename: labels.txt}"
)

# Demo repository contents: model name -> (builder, config.yaml text).
DEMO_MODELS: dict[str, tuple[Callable[[], bytes], str]] = {
    "simple": (simple_add_sub, SIMPLE_CONFIG),
    "classifier": (classifier, CLASSIFIER_DEMO_CONFIG),
}


# Demo models that are source, not generated: the camera pipeline's Python steps and
# the ensemble joining them to ``classifier``. They live in ``demo_models`` as they are
# and are copied from there.
PIPELINE_MODELS = ("preprocess", "postprocess", "image_classifier")
DEMO_DIR = Path(__file__).resolve().parent.parent / "appliance" / "demo_models"


def write_demo_repository(repo: Path) -> None:
    """Write the ``simple`` and ``classifier`` demo models and their config.yaml, and
    copy the ``image_classifier`` pipeline (preprocess -> classifier -> postprocess)."""
    for name, (build, config) in DEMO_MODELS.items():
        write_model(repo, name, build(), config)
    with open(Path(repo) / "classifier" / "labels.txt", "w", encoding="utf-8", newline="\n") as f:
        f.write(CLASSIFIER_LABELS)
    for name in PIPELINE_MODELS:
        source, target = DEMO_DIR / name, Path(repo) / name
        if source.resolve() != target.resolve():
            shutil.copytree(
                source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
            )


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: regenerate the demo model repository and print each file written."""
    parser = argparse.ArgumentParser(
        prog="python -m devtools.modelgen",
        description="Regenerate the demo model repository.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEMO_DIR,
        help="model repository to write (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    out: Path = args.out
    write_demo_repository(out)
    for name in DEMO_MODELS:
        for path in (out / name / "1" / "model.onnx", out / name / "config.yaml"):
            print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
