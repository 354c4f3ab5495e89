"""The model's request rules, and when they may rely on a codec having declared every
input to them already (through the request's admission ticket, for the same version)."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.config.model_config import ModelConfig, parse_model_config
from appliance.core.limits import RequestRules
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


def _request(arr: np.ndarray) -> InferenceRequest:
    return InferenceRequest("m", {"x": arr})


def test_a_request_is_checked_in_full_without_declarations() -> None:
    rules = RequestRules(_config([4]))
    assert rules.check(_request(np.zeros((3, 4), np.float32))) == (("y",), 3, (("x", (4,)),))
    for bad in (np.zeros((3, 5), np.float32), np.zeros((3, 4), np.int32), np.zeros((9, 4))):
        with pytest.raises(ApplianceError) as info:
            rules.check(_request(bad))
        assert info.value.code is Code.INVALID_ARG


def test_declarations_are_checked_with_the_same_rules() -> None:
    rules = RequestRules(_config([4]))
    assert rules.declare("x", "FP32", [3, 4]) == 3
    for name, datatype, shape in (
        ("x", "FP32", [3, 5]),
        ("x", "INT32", [3, 4]),
        ("z", "FP32", [1, 4]),
    ):
        with pytest.raises(ApplianceError) as info:
            rules.declare(name, datatype, shape)
        assert info.value.code is Code.INVALID_ARG


def test_declared_requests_skip_datatypes_and_shapes_only() -> None:
    rules = RequestRules(_config([4]))
    assert rules.check(_request(np.zeros((2, 4), np.float32)), declared=True) == (
        ("y",),
        2,
        (("x", (4,)),),
    )
    # the names are still the model's to check: an input it lacks, or one it needs
    with pytest.raises(ApplianceError):
        rules.check(InferenceRequest("m", {"z": np.zeros((2, 4))}), declared=True)
    with pytest.raises(ApplianceError):
        rules.check(InferenceRequest("m", {}), declared=True)
