"""``sequence_batching`` in config.yaml and config.pbtxt, and the direct strategy's rule."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sequence_models import ACCUMULATOR_PBTXT, CONTROLS_PBTXT

from appliance.config.fields import ConfigError
from appliance.config.model_config import parse_model_config
from appliance.config.sequence_config import CORRID, END, READY, START
from appliance.config.triton_config import json_to_dict, pbtxt_to_dict, to_triton_json
from appliance.core.sequence.strategy import DirectPlan, plan_direct


def _parse(sequence_batching: Any, **extra: Any) -> Any:
    doc = {"max_batch_size": 4, "sequence_batching": sequence_batching, **extra}
    return parse_model_config(doc, "m", "m/config.yaml")


def test_pbtxt_fields_reach_the_typed_config() -> None:
    text = CONTROLS_PBTXT % {"name": "m", "corrid_type": "TYPE_STRING", "idle": 7_000_000}
    sb = parse_model_config(pbtxt_to_dict(text, "m/config.pbtxt"), "m", "m").sequence_batching
    assert sb is not None and sb.strategy == "direct"
    assert sb.max_sequence_idle_us == 7_000_000
    kinds = {c.kind: (c.name, c.datatype, c.false_true) for c in sb.controls}
    assert kinds[START] == ("START", "FP32", (0.0, 1.0))
    assert kinds[END] == ("END", "INT32", (0, 1))
    assert kinds[READY] == ("READY", "BOOL", (False, True))
    assert kinds[CORRID][:2] == ("CORRID", "BYTES")


def test_a_sequence_without_an_idle_time_gets_tritons_default() -> None:
    text = CONTROLS_PBTXT % {"name": "m", "corrid_type": "TYPE_STRING", "idle": 1}
    text = text.replace("  max_sequence_idle_microseconds: 1\n", "")
    assert "max_sequence_idle" not in text
    sb = parse_model_config(pbtxt_to_dict(text, "m/config.pbtxt"), "m", "m").sequence_batching
    assert sb is not None and sb.max_sequence_idle_us == 1_000_000  # Triton's default


def test_the_config_endpoint_form_parses_back_to_the_same_config() -> None:
    text = ACCUMULATOR_PBTXT % {"idle": 250_000, "instances": 1}
    config = parse_model_config(pbtxt_to_dict(text, "a/config.pbtxt"), "accumulator", "a")
    again = parse_model_config(
        json_to_dict(json.dumps(to_triton_json(config)), "json"), "accumulator", "a"
    )
    assert again.sequence_batching == config.sequence_batching
    sb = config.sequence_batching
    assert sb is not None and sb.max_sequence_idle_us == 250_000
    state = sb.states[0]
    assert (state.input_name, state.output_name, state.initial_dims) == (
        "STATE_IN",
        "STATE_OUT",
        (1,),
    )


def test_oldest_strategy_from_yaml() -> None:
    sb = _parse(
        {"oldest": {"max_candidate_sequences": 8, "preferred_batch_size": [2, 4]}}
    ).sequence_batching
    assert (sb.strategy, sb.max_candidate_sequences, sb.preferred_batch_size) == (
        "oldest",
        8,
        (2, 4),
    )


@pytest.mark.parametrize(
    ("sequence_batching", "extra", "message"),
    [
        ({"direct": {}, "oldest": {}}, {}, "not both"),
        ({"iterative_sequence": True}, {}, "iterative sequences are not supported"),
        ({}, {"dynamic_batching": {}}, "not also dynamic_batching"),
        ({"control_input": [{"name": "S", "control": [{"kind": "CONTROL_X"}]}]}, {}, "kind"),
        (
            {"control_input": [{"name": "S", "control": [{"kind": "CONTROL_SEQUENCE_START"}]}]},
            {},
            "exactly one of int32_false_true",
        ),
        (
            {
                "control_input": [
                    {
                        "name": "C",
                        "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_FP32"}],
                    }
                ]
            },
            {},
            "TYPE_UINT64",
        ),
        (
            {
                "state": [
                    {
                        "input_name": "I",
                        "output_name": "O",
                        "data_type": "TYPE_INT32",
                        "dims": [2],
                        "initial_state": {
                            "name": "x",
                            "data_type": "TYPE_INT32",
                            "dims": [3],
                            "zero_data": True,
                        },
                    }
                ]
            },
            {},
            "do not match the state dims",
        ),
        (
            {"state": [{"input_name": "I", "output_name": "O", "data_type": "TYPE_INT32"}] * 2},
            {},
            "more than once",
        ),
        (
            {
                "control_input": [
                    {
                        "name": "a",
                        "control": [
                            {"kind": "CONTROL_SEQUENCE_READY", "bool_false_true": [False, True]}
                        ],
                    }
                ]
            },
            {"input": [{"name": "a", "data_type": "TYPE_BOOL", "dims": [1]}]},
            "leave them out of input and output",
        ),
    ],
)
def test_bad_sequence_batching_names_the_field(
    sequence_batching: Any, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        _parse(sequence_batching, **extra)
    assert "m/config.yaml: " in str(info.value)


def test_direct_rows_follow_the_slots() -> None:
    # slots 0 and 2 ready: three rows, the middle one a filler
    assert plan_direct([(0, "a", 1.0), (2, "a", 2.0)], 4, 3.0, 0.0, 0.0) == DirectPlan((0, -1, 2))
    # a request of another shape waits for the next batch
    assert plan_direct([(1, "a", 1.0), (3, "b", 1.0)], 4, 3.0, 0.0, 0.0) == DirectPlan((-1, 1))
    assert plan_direct([], 4, 3.0, 0.0, 0.0) == DirectPlan()


def test_direct_waits_for_slot_utilization_up_to_the_delay() -> None:
    heads = [(0, "a", 10.0)]
    # one of four slots ready, half wanted: wait the rest of the oldest's delay
    assert plan_direct(heads, 4, 10.25, 1.0, 0.5) == DirectPlan(wait_s=0.75)
    assert plan_direct(heads, 4, 11.0, 1.0, 0.5) == DirectPlan((0,))  # delay over
    two = [(0, "a", 10.0), (1, "a", 10.1)]
    assert plan_direct(two, 4, 10.2, 1.0, 0.5) == DirectPlan((0, 1))  # utilization met
