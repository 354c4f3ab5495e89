"""Cases of Triton's own server QA suite (``qa/L0_*``) written as our own tests: each
names the Triton test it follows, and asserts what real Triton 2.51 answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper


def _unknown_rank_identity(name: str) -> bytes:
    """Triton's ``gen_qa_ort_scalar_models``: an ONNX identity with no shape at all."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT"], ["OUTPUT"])],
        name,
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def test_scalar_io_models_with_config_dims_of_ones_serve(run_appliance, tmp_path: Path) -> None:
    # L0_scalar_io: ONNX Runtime reports shape [] for these; the config says [1], [1, 1]
    for name, dims in (("onnx_scalar_1dim", "1"), ("onnx_scalar_2dim", "1, 1")):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.onnx").write_bytes(_unknown_rank_identity(name))
        (tmp_path / name / "config.pbtxt").write_text(
            f'input [{{ name: "INPUT" data_type: TYPE_FP32 dims: [ {dims} ] }}]\n'
            f'output [{{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ {dims} ] }}]\n'
        )
    srv = run_appliance(tmp_path)
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    for name, value in (
        ("onnx_scalar_1dim", np.asarray([1], np.float32)),
        ("onnx_scalar_2dim", np.asarray([[1]], np.float32)),
    ):
        tensor = grpcclient.InferInput("INPUT", list(value.shape), "FP32")
        tensor.set_data_from_numpy(value)
        got = client.infer(name, [tensor]).as_numpy("OUTPUT")
        np.testing.assert_allclose(got, value)
    assert onnx  # the generator's package
