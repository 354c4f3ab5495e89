"""``triton_python_backend_utils`` (appliance.python_model) helpers, without a server."""

from __future__ import annotations

import numpy as np
import pytest

from appliance import python_model as pb_utils


def test_byte_tensors_round_trip_in_tritons_wire_form() -> None:
    values = np.array([b"a", b"", "caf\u00e9".encode()], dtype=object)
    encoded = pb_utils.serialize_byte_tensor(values)
    assert encoded.dtype == np.uint8 and encoded[:4].tobytes() == (1).to_bytes(4, "little")
    assert list(pb_utils.deserialize_bytes_tensor(encoded.tobytes())) == list(values)


def test_type_helpers() -> None:
    assert pb_utils.triton_string_to_numpy("TYPE_FP16") is np.float16
    assert pb_utils.triton_to_numpy_type("INT64") is np.int64
    assert pb_utils.numpy_to_triton_type(np.uint8) == "UINT8"
    config = {"output": [{"name": "OUT", "data_type": "TYPE_INT32"}]}
    assert pb_utils.get_output_config_by_name(config, "OUT") == config["output"][0]
    assert pb_utils.get_output_config_by_name(config, "nope") is None
    assert not pb_utils.using_decoupled_model_transaction_policy(config)


def test_response_sender_rules() -> None:
    sent: list[tuple[object, bool]] = []
    sender = pb_utils.InferenceResponseSender(lambda r, final: sent.append((r, final)))
    response = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1))])
    sender.send(response)
    with pytest.raises(pb_utils.TritonError, match="needs a response"):
        sender.send()
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    with pytest.raises(pb_utils.TritonError, match="already sent"):
        sender.send(response)
    assert sent == [(response, False), (None, True)]


def test_requests_of_regular_models_have_no_sender() -> None:
    request = pb_utils.InferenceRequest([pb_utils.Tensor("A", np.ones(2))], ["B"])
    with pytest.raises(pb_utils.TritonError, match="decoupled"):
        request.get_response_sender()
    assert pb_utils.get_input_tensor_by_name(request, "A") is request.inputs()[0]
    tensor = pb_utils.Tensor.from_dlpack("C", pb_utils.Tensor("A", np.arange(3)).to_dlpack())
    assert tensor.name() == "C" and list(tensor.as_numpy()) == [0, 1, 2] and tensor.is_cpu()
