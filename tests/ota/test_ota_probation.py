"""Probation counts the model's own failures: requests it failed (5xx class) and the
agent's probes it left unanswered, not requests the server rightly refused as the
client's fault; and it needs a minimum of answered requests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import urllib3

from tests.ota_helpers import Fleet, LocalDevice

MODEL = "pysimple"


def body(first: int = 1) -> dict[str, Any]:
    a = [first] + [1] * 15
    return {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": a},
            {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
        ]
    }


def during_probation(action: Callable[[], None]) -> Callable[[str], None]:
    return lambda phase: action() if phase == "probation" else None


def test_a_version_that_stops_answering_is_rolled_back(fleet: Fleet, device: LocalDevice) -> None:
    fleet.publish_python(1)
    assert device().run_once()
    fleet.publish_python(2, "hang")  # answers its self-test, then hangs
    agent = device(probation_s=1.0, probe_timeout_s=0.5)
    assert not agent.run_once()
    assert "probation" in agent.state.last_error and "probes" in agent.state.last_error
    assert agent.state.history[-1]["probation"]["probe_failures"] >= 1
    assert agent.state.models[MODEL].bad == [2] and agent.state.models[MODEL].current == 1
    assert device.serving(MODEL) == "1"


def test_requests_refused_as_the_clients_fault_do_not_roll_back(
    fleet: Fleet, device: LocalDevice
) -> None:
    fleet.publish(1)
    assert device().run_once()
    fleet.publish(2)
    url = device.url

    def garbage() -> None:  # a client sends the wrong shape: 400, the server is right
        wrong = {"inputs": [dict(body()["inputs"][0], shape=[1, 8], data=list(range(8)))]}
        for _ in range(5):
            r = urllib3.request("POST", f"{url}/v2/models/simple/infer", json=wrong)
            assert r.status == 400

    agent = device()
    agent.hook = during_probation(garbage)
    assert agent.run_once(), agent.state.last_error
    counted = agent.state.history[-1]["probation"]
    assert counted["client_errors"] == 5 and counted["model_failures"] == 0
    assert device.serving("simple") == "2"


def test_the_models_own_failures_roll_it_back(fleet: Fleet, device: LocalDevice) -> None:
    fleet.publish_python(1)
    assert device().run_once()
    fleet.publish_python(2, "fail")  # raises on inputs starting with -1
    url = device.url

    def failing_traffic() -> None:
        for _ in range(3):
            r = urllib3.request("POST", f"{url}/v2/models/{MODEL}/infer", json=body(-1))
            assert r.status == 500

    agent = device()
    agent.hook = during_probation(failing_traffic)
    assert not agent.run_once()
    assert "error rate 3/" in agent.state.last_error
    assert agent.state.history[-1]["probation"]["model_failures"] == 3
    assert agent.state.models[MODEL].bad == [2] and device.serving(MODEL) == "1"


def test_an_idle_device_passes_probation_with_probes_made_from_the_config(
    fleet: Fleet, device: LocalDevice
) -> None:
    """A night-time maintenance window: no traffic, and a bundle without vectors. The
    agent probes with zeros and random data of the config's shapes, and says so."""
    fleet.publish_python(1)
    assert device().run_once()
    fleet.publish_python(2, self_test=[])  # no vectors, and nobody calls it
    agent = device(probation_min_requests=5, probation_s=1.0, probation_poll_s=0.1)
    assert agent.run_once(), agent.state.last_error
    last = agent.state.history[-1]
    assert last["result"] == "updated" and last["probe"] == "generated"
    assert last["probation"]["probes"] >= 5 and last["probation"]["probe_failures"] == 0
    assert last["probation"]["success"] >= 5
    assert device.serving(MODEL) == "2"
    # generated probes prove the model answers: one that stops answering is caught
    fleet.publish_python(3, "hang", self_test=[])  # stops answering after one request
    agent = device(probation_s=1.0, probe_timeout_s=0.5)
    assert not agent.run_once()
    assert "timed out" in agent.state.last_error, agent.state.last_error
    assert agent.state.history[-1]["probe"] == "generated"
    assert agent.state.models[MODEL].bad == [3] and device.serving(MODEL) == "2"


def test_probation_needs_a_minimum_of_answered_requests(fleet: Fleet, device: LocalDevice) -> None:
    fleet.publish_python(1)
    assert device().run_once()
    fleet.publish_python(2, self_test=[])  # probes at each of a few polls, nobody else
    agent = device(probation_min_requests=50)
    assert not agent.run_once()
    assert "request(s) answered during probation, at least 50" in agent.state.last_error
    assert device.serving(MODEL) == "1"
    assert agent.state.models[MODEL].bad == [2]
