"""A detect -> crops -> recognise pipeline of small, real ONNX models, shaped as an OCR
pipeline is: the detector finds a data-dependent number of text lines in a page and
cuts them out, the recogniser reads one line a batch item. For the ensemble fan-out
tests and demos (dev/test tooling: ``onnx`` is a test extra).

A page is FP32 ``[H, 16]`` with ``H`` a multiple of :data:`LINE` rows: line ``i`` is
rows ``8i..8i+7``. A line is text when any of its pixels exceeds 0.5.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from devtools.modelgen import BATCH, _finish

LINE, WIDTH, CLASSES = 8, 16, 4

DETECTOR_CONFIG = """\
# lines of text in a page: crops [N, 8, 16] and their line numbers [N]
backend: onnxruntime
max_batch_size: 0
"""

RECOGNIZER_CONFIG = """\
# one text line a batch item: class scores and the best class
backend: onnxruntime
max_batch_size: 4
dynamic_batching: {max_queue_delay_microseconds: 2000}
"""

OCR_CONFIG = """\
# page in, the label of each text line out (the recogniser gets the crops as its batch)
platform: ensemble
max_batch_size: 0
input:
  - {name: page, data_type: TYPE_FP32, dims: [-1, 16]}
output:
  - {name: lines, data_type: TYPE_INT64, dims: [-1]}
  - {name: labels, data_type: TYPE_INT64, dims: [-1, 1]}
  - {name: scores, data_type: TYPE_FP32, dims: [-1, 4]}
ensemble_scheduling:
  step:
    - model_name: detector
      input_map: {page: page}
      output_map: {crops: crops, lines: lines}
    - model_name: recognizer
      input_map: {crop: crops}
      output_map: {label: labels, scores: scores}
"""


def detector() -> bytes:
    """FP32 "page" [H, 16] -> FP32 "crops" [N, 8, 16] and INT64 "lines" [N]: the lines
    with any pixel above 0.5, in page order (Reshape, ReduceMax, Compress)."""

    def const(name: str, values: list[int]) -> TensorProto:
        return numpy_helper.from_array(np.array(values, np.int64), name=name)

    threshold = numpy_helper.from_array(np.array(0.5, np.float32), name="threshold")
    nodes = [
        helper.make_node("Reshape", ["page", "line_shape"], ["all_lines"], name="split"),
        helper.make_node("ReduceMax", ["all_lines"], ["ink"], axes=[1, 2], keepdims=0),
        helper.make_node("Greater", ["ink", "threshold"], ["is_text"], name="is_text"),
        helper.make_node("Shape", ["ink"], ["count"], name="count"),
        helper.make_node("Squeeze", ["count", "zero"], ["count_scalar"], name="scalar"),
        helper.make_node(
            "Range", ["zero_scalar", "count_scalar", "one_scalar"], ["numbers"], name="numbers"
        ),
        helper.make_node("Compress", ["all_lines", "is_text"], ["crops"], axis=0, name="crops"),
        helper.make_node("Compress", ["numbers", "is_text"], ["lines"], axis=0, name="lines"),
    ]
    initializer = [
        const("line_shape", [-1, LINE, WIDTH]),
        const("zero", [0]),
        numpy_helper.from_array(np.array(0, np.int64), name="zero_scalar"),
        numpy_helper.from_array(np.array(1, np.int64), name="one_scalar"),
        threshold,
    ]
    page = helper.make_tensor_value_info("page", TensorProto.FLOAT, ["height", WIDTH])
    crops = helper.make_tensor_value_info("crops", TensorProto.FLOAT, ["n", LINE, WIDTH])
    lines = helper.make_tensor_value_info("lines", TensorProto.INT64, ["n"])
    return _finish("detector", nodes, [page], [crops, lines], initializer)


def recognizer(seed: int = 7) -> bytes:
    """FP32 "crop" [batch, 8, 16] -> FP32 "scores" [batch, 4] (a fixed linear read-out of
    the line's pixels less 0.8) and INT64 "label" [batch, 1] (the best class)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((LINE * WIDTH, CLASSES)).astype(np.float32)
    nodes = [
        helper.make_node("Sub", ["crop", "centre"], ["centred"], name="centre"),
        helper.make_node("Flatten", ["centred"], ["flat"], axis=1, name="flat"),
        helper.make_node("MatMul", ["flat", "weight"], ["scores"], name="read"),
        helper.make_node("ArgMax", ["scores"], ["label"], axis=1, keepdims=1, name="label"),
    ]
    crop = helper.make_tensor_value_info("crop", TensorProto.FLOAT, [BATCH, LINE, WIDTH])
    scores = helper.make_tensor_value_info("scores", TensorProto.FLOAT, [BATCH, CLASSES])
    label = helper.make_tensor_value_info("label", TensorProto.INT64, [BATCH, 1])
    initializer = [
        numpy_helper.from_array(weight, "weight"),
        numpy_helper.from_array(np.array(0.8, np.float32), "centre"),
    ]
    return _finish("recognizer", nodes, [crop], [scores, label], initializer)


def page(text_lines: list[int], height_lines: int, seed: int = 0) -> np.ndarray:
    """A page of ``height_lines`` lines where the lines numbered ``text_lines`` carry
    ink (random pixels in 0.6..1.0) and the others are blank (below 0.5)."""
    rng = np.random.default_rng(seed)
    out = rng.uniform(0.0, 0.4, (height_lines * LINE, WIDTH)).astype(np.float32)
    for i in text_lines:
        out[i * LINE : (i + 1) * LINE] = rng.uniform(0.6, 1.0, (LINE, WIDTH))
    return out
