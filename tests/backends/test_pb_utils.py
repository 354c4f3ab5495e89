"""``triton_python_backend_utils`` (appliance.python_model) helpers, without a server."""

from __future__ import annotations

import json

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
    # Triton's python_backend texts (response_sender.cc; L0_backend_python's
    # response_sender_complete_final compares the closed one exactly)
    sent: list[tuple[object, bool]] = []
    sender = pb_utils.InferenceResponseSender(lambda r, final: sent.append((r, final)))
    response = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1))])
    sender.send(response)
    with pytest.raises(pb_utils.TritonModelException, match="must be provided when the response"):
        sender.send()
    with pytest.raises(pb_utils.TritonModelException, match="Unsupported flag provided"):
        sender.send(response, flags=4)
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    with pytest.raises(pb_utils.TritonModelException) as closed:
        sender.send(response)
    assert str(closed.value) == "Unable to send response. Response sender has been closed."
    assert sent == [(response, False), (None, True)]


def test_a_regular_models_sender_takes_one_response() -> None:
    sent: list[tuple[object, bool]] = []
    sender = pb_utils.InferenceResponseSender(
        lambda r, final: sent.append((r, final)), decoupled=False
    )
    response = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1))])
    with pytest.raises(pb_utils.TritonModelException, match="cannot send complete final before"):
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    sender.send(response)
    with pytest.raises(pb_utils.TritonModelException, match="cannot send more than one"):
        sender.send(response)
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert sent == [(response, False), (None, True)]


def test_bls_request_parameters_are_checked_as_triton() -> None:
    request = pb_utils.InferenceRequest(
        model_name="m", inputs=[], requested_output_names=[], parameters={"a": 1, "b": True}
    )
    assert json.loads(request.parameters()) == {"a": 1, "b": True}
    assert request._as_request().parameters == {"a": 1, "b": True}
    with pytest.raises(pb_utils.TritonModelException, match="values to have type bool/int/str"):
        pb_utils.InferenceRequest(model_name="m", inputs=[], parameters={"a": 1.5})
    with pytest.raises(pb_utils.TritonModelException, match="keys to have type str"):
        pb_utils.InferenceRequest(model_name="m", inputs=[], parameters={1: "x"})


def test_requests_of_regular_models_have_no_sender() -> None:
    request = pb_utils.InferenceRequest([pb_utils.Tensor("A", np.ones(2))], ["B"])
    with pytest.raises(pb_utils.TritonModelException, match="execute"):
        request.get_response_sender()
    assert not request.is_cancelled()
    assert pb_utils.get_input_tensor_by_name(request, "A") is request.inputs()[0]
    tensor = pb_utils.Tensor.from_dlpack("C", pb_utils.Tensor("A", np.arange(3)).to_dlpack())
    assert tensor.name() == "C" and list(tensor.as_numpy()) == [0, 1, 2] and tensor.is_cpu()
