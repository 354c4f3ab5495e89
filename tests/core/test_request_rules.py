"""The model's request rules, and when they may rely on a codec's gate having applied
them already (the declarations it decoded were checked against the same config)."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.config.model_config import ModelConfig, parse_model_config
from appliance.core.model import RequestRules
from appliance.errors import ApplianceError, Code
from appliance.request import InferenceRequest


def _config(dims: list[int]) -> ModelConfig:
    return parse_model_config(
        {
            "max_batch_size": 8,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": dims}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": dims}],
        },
        "m",
        "test",
    )


def _request(arr: np.ndarray, checked_against: object = None) -> InferenceRequest:
    return InferenceRequest("m", {"x": arr}, checked_against=checked_against)


def test_a_request_is_checked_in_full_without_a_gate() -> None:
    rules = RequestRules(_config([4]))
    assert rules.check(_request(np.zeros((3, 4), np.float32))) == (("y",), 3, (("x", (4,)),))
    for bad in (np.zeros((3, 5), np.float32), np.zeros((3, 4), np.int32), np.zeros((9, 4))):
        with pytest.raises(ApplianceError) as info:
            rules.check(_request(bad))
        assert info.value.code is Code.INVALID_ARG


def test_a_gate_of_another_config_is_not_trusted() -> None:
    # a hot swap between the codec's gate and the model: the new config checks again
    old, new = _config([5]), _config([4])
    with pytest.raises(ApplianceError) as info:
        RequestRules(new).check(_request(np.zeros((3, 5), np.float32), checked_against=old))
    assert info.value.code is Code.INVALID_ARG and "shape" in info.value.message


def test_the_same_config_trusts_the_gate_for_datatypes_and_shapes_only() -> None:
    config = _config([4])
    rules = RequestRules(config)
    gated = _request(np.zeros((2, 4), np.float32), checked_against=config)
    assert rules.check(gated) == (("y",), 2, (("x", (4,)),))
    # the names are still the model's to check: an input it lacks, or one it needs
    with pytest.raises(ApplianceError):
        rules.check(InferenceRequest("m", {"z": np.zeros((2, 4))}, checked_against=config))
    with pytest.raises(ApplianceError):
        rules.check(InferenceRequest("m", {}, checked_against=config))
