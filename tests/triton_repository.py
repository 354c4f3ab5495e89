"""A model repository laid out and written the way Triton's documentation writes one.

Every model has a ``config.pbtxt``; the Python models import
``triton_python_backend_utils`` exactly as Triton's python_backend examples do and
know nothing of the appliance. Used by ``tests/test_triton_conformance.py``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from devtools import modelgen

ADD_SUB_CONFIG = """
name: "add_sub"
backend: "python"
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
instance_group [ { kind: KIND_CPU } ]
"""

ADD_SUB_PY = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if np.any(np.isnan(in_0)):
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError("INPUT0 holds a NaN")))
                continue
            out_0 = pb_utils.Tensor("OUTPUT0", (in_0 + in_1).astype(self.output0_dtype))
            out_1 = pb_utils.Tensor("OUTPUT1", (in_0 - in_1).astype(self.output1_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_0, out_1]))
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("add_sub: cleaning up")
"""

# python_backend's decoupled example, in its shape: one response per element of IN,
# sent from a thread of the model's own after execute returned, then the final flag
REPEAT_CONFIG = """
name: "repeat_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: True }
input [
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] }
]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

REPEAT_PY = """
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("repeat_int32 must be decoupled")
        self.out_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(model_config, "OUT")["data_type"])
        self.idx_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(model_config, "IDX")["data_type"])
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
            if values.shape != delays.shape:
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "IN and DELAY must have the same shape")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            thread = threading.Thread(
                target=self.respond, args=(request.get_response_sender(), values, delays))
            thread.start()
            self.threads.append(thread)
        return None

    def respond(self, sender, values, delays):
        for idx, (value, delay) in enumerate(zip(values, delays)):
            time.sleep(int(delay) / 1000)
            out = pb_utils.Tensor("OUT", np.array([value], self.out_dtype))
            index = pb_utils.Tensor("IDX", np.array([idx], self.idx_dtype))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out, index]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join()
"""

# BLS: one request to add_sub with exec(), one to the ONNX "simple" with async_exec()
BLS_CONFIG = """
name: "bls"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "Z" data_type: TYPE_INT32 dims: [ 16 ] }
]
"""

BLS_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            first = pb_utils.InferenceRequest(
                model_name="add_sub",
                requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", x), pb_utils.Tensor("INPUT1", x)],
            ).exec()
            if first.has_error():
                raise pb_utils.TritonModelException(first.error().message())
            doubled = pb_utils.get_output_tensor_by_name(first, "OUTPUT0").as_numpy()
            ones = np.ones((1, 16), np.int32)
            second = await pb_utils.InferenceRequest(
                model_name="simple",
                requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", ones), pb_utils.Tensor("INPUT1", ones)],
            ).async_exec()
            missing = pb_utils.InferenceRequest(
                model_name="no_such_model", requested_output_names=[], inputs=[]).exec()
            assert missing.has_error() and "unknown model" in missing.error().message()
            itself = pb_utils.InferenceRequest(
                model_name="bls", requested_output_names=["Y"], inputs=[request.inputs()[0]]
            ).exec()
            assert itself.has_error() and "cannot call itself" in itself.error().message()
            summed = pb_utils.get_output_tensor_by_name(second, "OUTPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", doubled), pb_utils.Tensor("Z", summed[0])]))
        return responses
"""

# BLS to a decoupled model: exec(decoupled=True) yields its responses, the last empty
BLS_REPEAT_CONFIG = """
name: "bls_repeat"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""

BLS_REPEAT_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            call = pb_utils.InferenceRequest(
                model_name="repeat_int32",
                requested_output_names=["OUT"],
                inputs=[
                    pb_utils.Tensor("IN", values),
                    pb_utils.Tensor("DELAY", np.zeros(values.shape, np.uint32)),
                    pb_utils.Tensor("WAIT", np.zeros([1], np.uint32)),
                ],
            )
            got = []
            for response in call.exec(decoupled=True):
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                out = pb_utils.get_output_tensor_by_name(response, "OUT")
                if out is not None:
                    got.append(int(out.as_numpy()[0]))
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(got, np.int32))]))
        return responses
'''

# NVIDIA's image examples reshape [1, N] to [N]-style: the client sees dims, the model reshape
RESHAPE_CONFIG = """
name: "reshaped"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  {
    name: "INPUT0"
    data_type: TYPE_INT32
    format: FORMAT_NCHW
    dims: [ 1, 4, 4 ]
    reshape: { shape: [ 16 ] }
  },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 2, 8 ] reshape: { shape: [ 16 ] } },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
"""

LABELS = ["cat", "dog", "bird", "fish", "frog"]
LABELLED_CONFIG = """
name: "labelled"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 5 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 5 ] label_filename: "labels.txt" } ]
"""

OPTIONAL_CONFIG = """
name: "optional_in"
backend: "python"
max_batch_size: 0
input [
  { name: "A" data_type: TYPE_FP32 dims: [ 2 ] },
  { name: "B" data_type: TYPE_FP32 dims: [ 2 ] optional: true }
]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""

OPTIONAL_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "B")
            total = a if b is None else a + b.as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)]))
        return responses
"""


def _python_model(repo: Path, name: str, config: str, source: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(textwrap.dedent(config).lstrip())
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(source).lstrip())


def _onnx_model(repo: Path, name: str, model: bytes, config: str) -> Path:
    folder = modelgen.write_model(repo, name, model)
    (folder / "config.pbtxt").write_text(textwrap.dedent(config).lstrip())
    return folder


def write_triton_repository(repo: Path) -> Path:
    modelgen.write_model(repo, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
    _python_model(repo, "add_sub", ADD_SUB_CONFIG, ADD_SUB_PY)
    _python_model(repo, "repeat_int32", REPEAT_CONFIG, REPEAT_PY)
    _python_model(repo, "bls", BLS_CONFIG, BLS_PY)
    _python_model(repo, "optional_in", OPTIONAL_CONFIG, OPTIONAL_PY)
    _python_model(repo, "bls_repeat", BLS_REPEAT_CONFIG, BLS_REPEAT_PY)
    _onnx_model(repo, "reshaped", modelgen.simple_add_sub(), RESHAPE_CONFIG)
    folder = _onnx_model(repo, "labelled", modelgen.identity("FP32", [5]), LABELLED_CONFIG)
    (folder / "labels.txt").write_text("\n".join(LABELS) + "\n")
    return repo
