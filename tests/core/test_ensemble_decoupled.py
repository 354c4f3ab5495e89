"""Decoupled models as ensemble steps, as L0_decoupled serves them: ``repeat_int32`` (0..N
responses a request) alone and behind ``simple_repeat``, ``sequence_repeat``,
``fan_repeat``, ``repeat_square`` and ``nested_square`` (an ensemble of an ensemble),
over gRPC streams of a real server on 127.0.0.1; BLS ``exec(decoupled=True)`` and
``async_exec(decoupled=True)`` of the same model; the load-time rule on where a step's
inputs come from (L0_model_config's ``invalid_decoupled_branching``). The models are our
own equivalents of Triton's (python_backend's ``examples/decoupled``).
:func:`decoupled_repository` is also the repository ``tests/test_triton_qa_suite.py``
serves to Triton's own ``decoupled_test.py`` (its ``fan_repeat`` reads a libtorch
model: here a Python one with the same tensors)."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

REPEAT_PY = """\
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("repeat_int32 must be decoupled")

    def execute(self, requests):
        request = requests[0]
        values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
        if values.shape != delays.shape:
            raise pb_utils.TritonModelException(
                f"expected IN and DELAY shape to match, got {list(values.shape)} and "
                f"{list(delays.shape)}."
            )
        sender = request.get_response_sender()

        def answer():
            for idx in range(values.size):
                time.sleep(delays[idx] / 1000)
                sender.send(
                    pb_utils.InferenceResponse(
                        [
                            pb_utils.Tensor("IDX", np.array([idx], np.uint32)),
                            pb_utils.Tensor("OUT", np.array([values[idx]], np.int32)),
                        ]
                    )
                )
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        threading.Thread(target=answer, daemon=True).start()
        wait = pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy()
        time.sleep(wait[0] / 1000)
        return None
"""

SQUARE_PY = """\
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()

            def answer(value=value, sender=sender):
                for _ in range(value):
                    out = pb_utils.Tensor("OUT", np.array([value], np.int32))
                    sender.send(pb_utils.InferenceResponse([out]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

            threading.Thread(target=answer, daemon=True).start()
        return None
"""

IDENTITY_PY = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value)]))
        return out
"""

ADD_SUB_PY = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            tensors = [pb_utils.Tensor("OUTPUT__0", a - b), pb_utils.Tensor("OUTPUT__1", a + b)]
            out.append(pb_utils.InferenceResponse(tensors))
        return out
"""

BLS_PY = """\
import numpy as np
import triton_python_backend_utils as pb_utils


def repeat(values):
    return pb_utils.InferenceRequest(
        model_name="repeat_int32",
        inputs=[
            pb_utils.Tensor("IN", values),
            pb_utils.Tensor("DELAY", np.zeros(values.shape, np.uint32)),
            pb_utils.Tensor("WAIT", np.zeros([1], np.uint32)),
        ],
        requested_output_names=["OUT"],
    )


def gathered(responses):
    got = []
    for response in responses:
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        out = pb_utils.get_output_tensor_by_name(response, "OUT")
        if out is not None:  # the final response may be empty
            got.extend(out.as_numpy().tolist())
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(got, np.int32))])


"""

SYNC_CLASS = """
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out.append(gathered(repeat(values).exec(decoupled=True)))
        return out
"""

ASYNC_CLASS = """
class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out.append(gathered(await repeat(values).async_exec(decoupled=True)))
        return out
"""

_REPEAT_IO = """\
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
        { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
        { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] } ]
"""
_DECOUPLED = 'backend: "python"\nmax_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n'
_OUT = 'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
_OUT_IDX = (
    'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },\n'
    '         { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]\n'
)
_REPEAT_IN = {"IN": "IN", "DELAY": "DELAY", "WAIT": "WAIT"}


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'{{ model_name: "{model}" model_version: -1 {" ".join(maps)} }}'


def _ensemble(outputs: str, *steps: str) -> str:
    return (
        'platform: "ensemble"\nmax_batch_size: 0\n'
        + _REPEAT_IO
        + outputs
        + "ensemble_scheduling { step [\n  "
        + ",\n  ".join(steps)
        + "\n] }\n"
    )


def _model(repo: Path, name: str, config: str, code: str | None = None) -> None:
    (repo / name / "1").mkdir(parents=True)
    if code is not None:
        (repo / name / "1" / "model.py").write_text(code)
    (repo / name / "config.pbtxt").write_text(config)


def decoupled_repository(repo: Path) -> Path:
    """L0_decoupled's ``python_models`` repository, our own models and configs."""
    _model(repo, "repeat_int32", _DECOUPLED + _REPEAT_IO + _OUT_IDX, REPEAT_PY)
    _model(
        repo,
        "square_int32",
        _DECOUPLED + 'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n' + _OUT,
        SQUARE_PY,
    )
    _model(
        repo,
        "identity_int32",
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ -1 ] } ]\n',
        IDENTITY_PY,
    )
    _model(
        repo,
        "libtorch_nobatch_int32_int32_int32",
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] },\n'
        '        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_INT32 dims: [ 1 ] },\n'
        '         { name: "OUTPUT__1" data_type: TYPE_INT32 dims: [ 1 ] } ]\n',
        ADD_SUB_PY,
    )
    repeat_out = {"OUT": "repeat_out"}
    _model(
        repo,
        "simple_repeat",
        _ensemble(_OUT_IDX, _step("repeat_int32", _REPEAT_IN, {"OUT": "OUT", "IDX": "IDX"})),
    )
    _model(
        repo,
        "sequence_repeat",
        _ensemble(
            _OUT_IDX,
            _step("repeat_int32", _REPEAT_IN, {"OUT": "repeat_out", "IDX": "IDX"}),
            _step("identity_int32", {"INPUT0": "repeat_out"}, {"OUTPUT0": "OUT"}),
        ),
    )
    _model(
        repo,
        "fan_repeat",
        _ensemble(
            _OUT,
            _step("repeat_int32", _REPEAT_IN, repeat_out),
            _step("identity_int32", {"INPUT0": "repeat_out"}, {"OUTPUT0": "identity_out"}),
            _step(
                "libtorch_nobatch_int32_int32_int32",
                {"INPUT0": "repeat_out", "INPUT1": "identity_out"},
                {"OUTPUT__1": "OUT"},
            ),
        ),
    )
    _model(
        repo,
        "repeat_square",
        _ensemble(
            _OUT,
            _step("repeat_int32", _REPEAT_IN, repeat_out),
            _step("square_int32", {"IN": "repeat_out"}, {"OUT": "OUT"}),
        ),
    )
    _model(
        repo,
        "nested_square",
        _ensemble(
            _OUT,
            _step("simple_repeat", _REPEAT_IN, repeat_out),
            _step("square_int32", {"IN": "repeat_out"}, {"OUT": "OUT"}),
        ),
    )
    return repo


def _inputs(values: list[int], delays: list[int], wait: int) -> list[grpcclient.InferInput]:
    tensors = []
    for name, data in (
        ("IN", np.array(values, np.int32)),
        ("DELAY", np.array(delays, np.uint32)),
        ("WAIT", np.array([wait], np.uint32)),
    ):
        tensor = grpcclient.InferInput(
            name, list(data.shape), "INT32" if name == "IN" else "UINT32"
        )
        tensor.set_data_from_numpy(data)
        tensors.append(tensor)
    return tensors


def _stream(
    url: str, model: str, requests: list[list[int]], outputs: list[str]
) -> dict[str, list[object]]:
    """Send each request on one stream (ids "0", "1", ...) with empty final responses
    on; each request's non-empty responses in arrival order, once every final came."""
    answers: queue.Queue[object] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        for i, values in enumerate(requests):
            client.async_stream_infer(
                model,
                _inputs(values, [5] * len(values), 2),
                request_id=str(i),
                outputs=[grpcclient.InferRequestedOutput(n) for n in outputs],
                enable_empty_final_response=True,
            )
        got: dict[str, list[object]] = {str(i): [] for i in range(len(requests))}
        finals = 0
        while finals < len(requests):
            item = answers.get(timeout=120)
            if isinstance(item, InferenceServerException):
                raise item
            response = item.get_response()  # type: ignore[attr-defined]
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
            if response.outputs:
                got[response.id].append(item)
        return got
    finally:
        client.stop_stream()
        client.close()


def _out(result: object) -> int:
    values = result.as_numpy("OUT")  # type: ignore[attr-defined]
    assert values.shape == (1,)
    return int(values[0])


@pytest.mark.parametrize(
    "model", ["repeat_int32", "simple_repeat", "sequence_repeat", "fan_repeat"]
)
def test_each_response_of_a_repeat_step_flows_through_the_ensemble(
    run_appliance, tmp_path: Path, model: str
) -> None:
    # L0_decoupled test_one_to_none / one_to_one / one_to_many, with IDX where the
    # ensemble has it and fan_repeat's 2 * IN
    srv = run_appliance(decoupled_repository(tmp_path))
    with_idx = model != "fan_repeat"
    outputs = ["OUT", "IDX"] if with_idx else ["OUT"]
    requests = [[], [100], [100, 101, 102, 103, 104], [7, 8]]
    got = _stream(srv.grpc_url, model, requests, outputs)
    for i, values in enumerate(requests):
        answers = got[str(i)]
        factor = 2 if model == "fan_repeat" else 1
        assert [_out(a) for a in answers] == [factor * v for v in values]
        if with_idx:
            assert [int(a.as_numpy("IDX")[0]) for a in answers] == list(range(len(values)))


@pytest.mark.parametrize("model", ["repeat_square", "nested_square"])
def test_a_decoupled_step_after_a_decoupled_step_answers_for_each_response(
    run_appliance, tmp_path: Path, model: str
) -> None:
    # L0_decoupled's _nested_validate: repeat's n-th value v comes back v times
    srv = run_appliance(decoupled_repository(tmp_path))
    got = _stream(srv.grpc_url, model, [[2, 3, 4], [], [1]], ["OUT"])
    assert [_out(a) for a in got["0"]] == [2, 2, 3, 3, 3, 4, 4, 4, 4]
    assert got["1"] == []
    assert [_out(a) for a in got["2"]] == [1]


def test_a_decoupled_ensemble_is_refused_where_one_answer_is_expected(
    run_appliance, tmp_path: Path
) -> None:
    # L0_decoupled test_no_streaming, for the ensembles too
    srv = run_appliance(decoupled_repository(tmp_path))
    http = httpclient.InferenceServerClient(srv.url)
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    for model in ("repeat_int32", "simple_repeat", "nested_square"):
        tensors = []
        for name, data in (
            ("IN", np.array([1], np.int32)),
            ("DELAY", np.array([1], np.uint32)),
            ("WAIT", np.array([1], np.uint32)),
        ):
            tensor = httpclient.InferInput(name, [1], "INT32" if name == "IN" else "UINT32")
            tensor.set_data_from_numpy(data)
            tensors.append(tensor)
        with pytest.raises(InferenceServerException, match="doesn't support models with decoupled"):
            http.infer(model, tensors)
        with pytest.raises(InferenceServerException, match="doesn't support models with decoupled"):
            grpc.infer(model, _inputs([1], [1], 1))


def test_an_error_of_a_decoupled_step_is_a_response_of_the_stream(
    run_appliance, tmp_path: Path
) -> None:
    # L0_decoupled test_wrong_shape, alone and as an ensemble step
    srv = run_appliance(decoupled_repository(tmp_path))
    for model in ("repeat_int32", "simple_repeat"):
        answers: queue.Queue[object] = queue.Queue()
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        client.start_stream(callback=lambda result, error, q=answers: q.put(error or result))
        client.async_stream_infer(model, _inputs([1], [5, 5], 2), request_id="0")
        error = answers.get(timeout=120)
        client.stop_stream()
        assert isinstance(error, InferenceServerException)
        assert "expected IN and DELAY shape to match, got [1] and [2]" in str(error)


@pytest.mark.parametrize("variant", [SYNC_CLASS, ASYNC_CLASS], ids=["exec", "async_exec"])
def test_bls_reads_every_response_of_a_decoupled_model(
    run_appliance, tmp_path: Path, variant: str
) -> None:
    repo = decoupled_repository(tmp_path)
    _model(
        repo,
        "bls_repeat",
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]\n',
        BLS_PY + variant,
    )
    srv = run_appliance(repo)
    http = httpclient.InferenceServerClient(srv.url)
    tensor = httpclient.InferInput("IN", [3], "INT32")
    tensor.set_data_from_numpy(np.array([5, 6, 7], np.int32))
    assert http.infer("bls_repeat", [tensor]).as_numpy("OUT").tolist() == [5, 6, 7]


def test_a_step_reading_two_decoupled_steps_is_refused_at_load(
    run_appliance, tmp_path: Path
) -> None:
    # L0_model_config's invalid_decoupled_branching(_2): Triton's texts
    repo = decoupled_repository(tmp_path)
    two = {"OUT": "repeat_1_out"}, {"OUT": "repeat_2_out"}
    _model(
        repo,
        "invalid_decoupled_branching",
        _ensemble(
            _OUT,
            _step("repeat_int32", _REPEAT_IN, two[0]),
            _step("repeat_int32", _REPEAT_IN, two[1]),
            _step(
                "libtorch_nobatch_int32_int32_int32",
                {"INPUT0": "repeat_1_out", "INPUT1": "repeat_2_out"},
                {"OUTPUT__1": "OUT"},
            ),
        ),
    )
    _model(
        repo,
        "invalid_decoupled_branching_2",
        _ensemble(
            _OUT_IDX,
            _step("repeat_int32", _REPEAT_IN, {"OUT": "OUT"}),
            _step("repeat_int32", _REPEAT_IN, {"IDX": "IDX"}),
        ),
    )
    srv = run_appliance(repo)
    lifecycle = srv.server.lifecycle
    assert (
        "in ensemble invalid_decoupled_branching, step of model "
        "'libtorch_nobatch_int32_int32_int32' receives inputs originated from different "
        "decoupled models" in lifecycle.entry("invalid_decoupled_branching").reason
    )
    assert (
        "in ensemble invalid_decoupled_branching_2, step of model "
        "'invalid_decoupled_branching_2' receives inputs originated from different "
        "decoupled models" in lifecycle.entry("invalid_decoupled_branching_2").reason
    )


UNTIL_CANCELLED_PY = """\
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        request = requests[0]
        sender = request.get_response_sender()
        value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        for _ in range(1200):  # bounded: two minutes
            if sender.is_cancelled():
                open(os.path.join(os.environ["QA_GATE_DIR"], "cancelled"), "w").close()
                break
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value[:1])]))
            time.sleep(0.1)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_a_closed_stream_reaches_the_decoupled_step_of_an_ensemble(
    run_appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("QA_GATE_DIR", str(gate))
    repo = decoupled_repository(tmp_path / "repo")
    _model(repo, "until_cancelled", _DECOUPLED + _REPEAT_IO + _OUT, UNTIL_CANCELLED_PY)
    _model(
        repo,
        "cancel_chain",
        _ensemble(
            'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]\n',
            _step("until_cancelled", _REPEAT_IN, {"OUT": "step_out"}),
            _step("identity_int32", {"INPUT0": "step_out"}, {"OUTPUT0": "OUT"}),
        ),
    )
    srv = run_appliance(repo)
    answers: queue.Queue[object] = queue.Queue()
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    client.async_stream_infer("cancel_chain", _inputs([9], [0], 0))
    assert _out(answers.get(timeout=120)) == 9
    client.stop_stream(cancel_requests=True)
    for _ in range(1200):  # bounded: two minutes
        if (gate / "cancelled").exists():
            break
        time.sleep(0.1)
    assert (gate / "cancelled").exists()


GATED_PY = """\
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def out(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))])


class TritonPythonModel:
    def execute(self, requests):
        sender = requests[0].get_response_sender()
        value = int(pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()[0])
        gate = os.path.join(os.environ["QA_GATE_DIR"], "open")

        def answer():
            sender.send(out(value))
            if value == 0:  # the rest only once the test saw another request's answer
                for _ in range(1200):  # bounded: two minutes
                    if os.path.exists(gate):
                        break
                    time.sleep(0.1)
                sender.send(out(100))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        threading.Thread(target=answer, daemon=True).start()
        return None
"""


def test_a_decoupled_models_responses_interleave_with_later_requests(
    run_appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # L0_decoupled test_response_order: Triton writes a decoupled model's responses as
    # they come, whatever the request order on the stream (a regular model's keep it)
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("QA_GATE_DIR", str(gate))
    repo = tmp_path / "repo"
    _model(
        repo,
        "gated",
        _DECOUPLED + 'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n' + _OUT,
        GATED_PY,
    )
    srv = run_appliance(repo)
    answers: queue.Queue[object] = queue.Queue()
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        for i, value in enumerate((0, 7)):
            tensor = grpcclient.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([value], np.int32))
            client.async_stream_infer("gated", [tensor], request_id=str(i))
        seen = [_out(answers.get(timeout=120)) for _ in range(2)]
        assert sorted(seen) == [0, 7]  # request 1 answered while request 0 still runs
        (gate / "open").touch()
        assert _out(answers.get(timeout=120)) == 100
    finally:
        (gate / "open").touch()
        client.stop_stream()
