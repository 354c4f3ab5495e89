"""Ensembles built the way Triton's QA builds them: the batch dimension carried
through steps that batch and steps that do not (Triton's ``nop`` models), labels of
a step's output answering classification through the ensemble, and ensembles of
ensembles, with real ONNX models and a real server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from appliance.core.ensemble.plan import carried_shape
from devtools import modelgen
from tests.core.test_ensemble import load_reason

NOP = """\
backend: onnxruntime
max_batch_size: 1024
input: [{name: INPUT0, data_type: TYPE_FP32, dims: [-1]}]
output: [{name: OUTPUT0, data_type: TYPE_FP32, dims: [-1]}]
"""
ADD = """\
backend: onnxruntime
max_batch_size: 0
input:
  - {name: A, data_type: TYPE_FP32, dims: [-1]}
  - {name: B, data_type: TYPE_FP32, dims: [-1]}
output: [{name: SUM, data_type: TYPE_FP32, dims: [-1]}]
"""


def _step(model: str, inputs: str, outputs: str) -> str:
    return f"    - {{model_name: {model}, input_map: {{{inputs}}}, output_map: {{{outputs}}}}}\n"


def _ensemble(batch: int, dims: str, steps: str, label: str = "") -> str:
    return (
        f"platform: ensemble\nmax_batch_size: {batch}\n"
        f"input:\n  - {{name: X, data_type: TYPE_FP32, dims: {dims}}}\n"
        f"  - {{name: Y, data_type: TYPE_FP32, dims: {dims}}}\n"
        f"output:\n  - {{name: Z, data_type: TYPE_FP32, dims: {dims}{label}}}\n"
        f"ensemble_scheduling:\n  step:\n{steps}"
    )


# ensemble inputs -> nop (batches) -> add (does not) -> ensemble output
THROUGH_NOP = (
    _step("nop", "INPUT0: X", "OUTPUT0: x")
    + _step("nop", "INPUT0: Y", "OUTPUT0: y")
    + _step("add", "A: x, B: y", "SUM: Z")
)


def _repo(repo: Path, **ensembles: str) -> Path:
    modelgen.write_model(repo, "nop", modelgen.identity("FP32", [-1]), NOP)
    modelgen.write_model(repo, "add", modelgen.no_batch_add((-1,)), ADD)
    for name, config in ensembles.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.yaml").write_text(config)
    return repo


def _ask(client: httpclient.InferenceServerClient, model: str, x: np.ndarray) -> np.ndarray:
    tensors = []
    for name in ("X", "Y"):
        t = httpclient.InferInput(name, list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        tensors.append(t)
    return client.infer(model, tensors).as_numpy("Z")


def test_carried_shape_is_tritons_rule() -> None:
    # into a step that batches from a source that does not: a batch of one when the
    # dims fit, else the tensor is a batch already
    assert carried_shape((-1,), True, 0, (16,)) == (1, 16)
    assert carried_shape((-1,), True, 0, (0,)) == (1, 0)
    assert carried_shape((4,), True, 0, (3, 4)) == (3, 4)
    # into a step that does not batch: a batch dim of one dropped where dims differ
    assert carried_shape((-1,), False, 1, (1, 16)) == (16,)
    assert carried_shape((-1, 4), False, 1, (1, 4)) == (1, 4)
    assert carried_shape((-1,), False, 2, (2, 16)) == (2, 16)
    # both sides alike: as is
    assert carried_shape((-1,), True, 3, (3, 16)) == (3, 16)
    assert carried_shape((-1,), False, 0, (16,)) == (16,)


def test_the_batch_dim_passes_through_batching_and_non_batching_steps(
    run_appliance, tmp_path: Path
) -> None:
    batching = _ensemble(
        8,
        "[-1]",
        _step("add2", "A: X, B: Y", "SUM: s")  # does not batch: [2, 4] as one tensor
        + _step("nop", "INPUT0: s", "OUTPUT0: Z"),
    )
    repo = _repo(tmp_path, nobatch=_ensemble(0, "[-1]", THROUGH_NOP), batching=batching)
    add2 = ADD.replace("dims: [-1]", "dims: [-1, -1]")
    modelgen.write_model(repo, "add2", modelgen.no_batch_add((-1, -1)), add2)
    srv = run_appliance(repo)
    client = httpclient.InferenceServerClient(srv.url)
    x = np.arange(16, dtype=np.float32)
    # Triton: "expected shape [-1, -1], got [16]" was ours; the nop gets [1, 16]
    np.testing.assert_array_equal(_ask(client, "nobatch", x), 2 * x)
    zero = _ask(client, "nobatch", np.zeros((0,), np.float32))
    assert zero.shape == (0,)
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(_ask(client, "batching", rows), 2 * rows)
    nop = client.get_inference_statistics("nop")["model_stats"][0]
    assert nop["inference_count"] == 4 + 2  # 4 requests of one, then a batch of 2


def test_classification_through_an_ensemble_keeps_the_steps_labels(
    run_appliance, tmp_path: Path
) -> None:
    tagged = NOP.replace(
        "OUTPUT0, data_type: TYPE_FP32, dims: [-1]}",
        "OUTPUT0, data_type: TYPE_FP32, dims: [-1], label_filename: labels.txt}",
    )
    steps = _step("add", "A: X, B: Y", "SUM: s") + _step("tagged", "INPUT0: s", "OUTPUT0: Z")
    repo = _repo(tmp_path, pipe=_ensemble(8, "[-1]", steps))
    modelgen.write_model(repo, "tagged", modelgen.identity("FP32", [-1]), tagged)
    (repo / "tagged" / "labels.txt").write_text("zero\none\ntwo\nthree\n")
    srv = run_appliance(repo)
    client = httpclient.InferenceServerClient(srv.url)
    tensors = []
    for name in ("X", "Y"):
        t = httpclient.InferInput(name, [1, 4], "FP32")
        t.set_data_from_numpy(np.array([[1, 4, 2, 3]], np.float32))
        tensors.append(t)
    out = httpclient.InferRequestedOutput("Z", class_count=2)
    got = client.infer("pipe", tensors, outputs=[out]).as_numpy("Z")
    assert got.tolist() == [[b"8.000000:1:one", b"6.000000:3:three"]]


def test_nested_ensembles_load_after_the_ensembles_they_call(run_appliance, tmp_path: Path) -> None:
    # "outer" sorts before "inner": the order comes from the steps, not the names
    outer = _ensemble(0, "[-1]", _step("inner", "X: X, Y: Y", "Z: Z"))
    srv = run_appliance(_repo(tmp_path, inner=_ensemble(0, "[-1]", THROUGH_NOP), a_outer=outer))
    client = httpclient.InferenceServerClient(srv.url)
    x = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(_ask(client, "a_outer", x), 2 * x)


def test_a_step_whose_max_batch_size_is_below_the_ensembles_is_refused(tmp_path: Path) -> None:
    repo = _repo(tmp_path, pipe=_ensemble(2048, "[-1]", THROUGH_NOP))
    reason = asyncio.run(load_reason(repo))
    assert (
        "ensemble pipe allows maximum batch size 2048, but it contains model nop which "
        "only allows maximum batch size to be 1024"
    ) in reason


def test_a_batch_that_cannot_pass_a_non_batching_step_fails_that_request(
    run_appliance, tmp_path: Path
) -> None:
    # [-1] through add (dims [-1]): a batch of 2 stays [2, 4], which add refuses
    srv = run_appliance(_repo(tmp_path, pipe=_ensemble(8, "[4]", THROUGH_NOP)))
    client = httpclient.InferenceServerClient(srv.url)
    with pytest.raises(InferenceServerException) as refused:
        _ask(client, "pipe", np.ones((2, 4), np.float32))
    assert refused.value.status() == "400"
    one = _ask(client, "pipe", np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(one, np.full((1, 4), 2, np.float32))


OPTIONAL_IDENTITY = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            outs = []
            for i in ("0", "1"):
                tensor = pb_utils.get_input_tensor_by_name(request, "INPUT" + i)
                if tensor is not None:
                    outs.append(pb_utils.Tensor("OUTPUT" + i, tensor.as_numpy()))
            responses.append(pb_utils.InferenceResponse(outs))
        return responses
"""
TWO = """\
  - {name: INPUT0, data_type: TYPE_FP32, dims: [1], optional: true}
  - {name: INPUT1, data_type: TYPE_FP32, dims: [1], optional: true}
"""


def test_optional_ensemble_inputs_left_out_leave_their_steps_inputs_out(
    run_appliance, tmp_path: Path
) -> None:
    (tmp_path / "opt" / "1").mkdir(parents=True)
    (tmp_path / "opt" / "1" / "model.py").write_text(OPTIONAL_IDENTITY)
    outs = TWO.replace("INPUT", "OUTPUT").replace(", optional: true", "")
    (tmp_path / "opt" / "config.yaml").write_text(
        f"backend: python\nmax_batch_size: 4\ninput:\n{TWO}output:\n{outs}"
    )
    (tmp_path / "pipe" / "1").mkdir(parents=True)
    (tmp_path / "pipe" / "config.yaml").write_text(
        f"platform: ensemble\nmax_batch_size: 4\ninput:\n{TWO}output:\n{outs}"
        "ensemble_scheduling:\n  step:\n"
        + _step("opt", "INPUT0: INPUT0, INPUT1: INPUT1", "OUTPUT0: a, OUTPUT1: b")
        + _step("opt", "INPUT0: a, INPUT1: b", "OUTPUT0: OUTPUT0, OUTPUT1: OUTPUT1")
    )
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url)
    one = httpclient.InferInput("INPUT1", [1, 1], "FP32")
    one.set_data_from_numpy(np.full((1, 1), 7, np.float32))
    result = client.infer("pipe", [one], outputs=[httpclient.InferRequestedOutput("OUTPUT1")])
    assert result.as_numpy("OUTPUT1").tolist() == [[7.0]]
    both = [one, httpclient.InferInput("INPUT0", [1, 1], "FP32")]
    both[1].set_data_from_numpy(np.full((1, 1), 3, np.float32))
    result = client.infer("pipe", both)
    assert result.as_numpy("OUTPUT0").tolist() == [[3.0]]
    assert result.as_numpy("OUTPUT1").tolist() == [[7.0]]
