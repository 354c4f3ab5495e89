"""The sequence batcher end to end: Triton's clients against stateful models.

Models come from tests/sequence_models.py: an ONNX accumulator with implicit state
(OUTPUT = INPUT + STATE, fed back by the server), Python models that echo the
control inputs they are fed, and a Python model that counts inside its instance.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from docs_examples import examples
from sequence_models import write_batching_repository, write_counter, write_sequence_repository
from tritonclient.utils import InferenceServerException

from appliance import InProcessServer

START_ERROR = "must specify the START flag on the first request of the sequence"


@pytest.fixture
def sequence_repo(tmp_path: Path) -> Path:
    return write_sequence_repository(tmp_path / "repo")


def _input(client: Any, value: int, rows: int = 1) -> Any:
    """An INPUT tensor for ``client`` (a client object or the client module)."""
    grpc = client is grpcclient or isinstance(client, grpcclient.InferenceServerClient)
    tensor = (grpcclient if grpc else httpclient).InferInput("INPUT", [rows, 1], "INT32")
    tensor.set_data_from_numpy(np.full((rows, 1), value, np.int32))
    return tensor


def _accumulate(client: Any, model: str, value: int, sid: int | str, **flags: bool) -> int:
    result = client.infer(
        model,
        [_input(client, value)],
        sequence_id=sid,
        **{f"sequence_{k}": v for k, v in flags.items()},
    )
    return int(result.as_numpy("OUTPUT")[0, 0])


def _interleaved(client: Any, model: str, base: int = 0) -> tuple[list[int], list[int]]:
    """Two sequences interleaved, one with a uint64 id, one with a string id, as
    Triton's simple sequence clients run them."""
    values = [11, 7, 5, 3, 2, 0, 1]
    got: tuple[list[int], list[int]] = ([], [])
    for i, v in enumerate(values):
        flags = {"start": i == 0, "end": i == len(values) - 1}
        got[0].append(_accumulate(client, model, v, 1000 + base, **flags))
        got[1].append(_accumulate(client, model, -v, f"seq-{base}", **flags))
    return got


def _expected(values: list[int], start: int = 0) -> list[int]:
    return [int(x) + start for x in np.cumsum(values)]


def test_http_sequences_keep_their_own_state(
    run_appliance: Callable[..., Any], sequence_repo: Path
) -> None:
    srv = run_appliance(sequence_repo)
    client = httpclient.InferenceServerClient(srv.url)
    values = [11, 7, 5, 3, 2, 0, 1]
    first, second = _interleaved(client, "accumulator")
    assert first == _expected(values)
    assert second == _expected([-v for v in values])
    # the oldest strategy, config.yaml form, initial state 100 read from a data_file
    first, second = _interleaved(client, "accumulator_oldest", base=1)
    assert first == _expected(values, 100)
    assert second == _expected([-v for v in values], 100)
    # a START on an id whose sequence ended begins from the initial state again
    assert _accumulate(client, "accumulator", 4, 1000, start=True, end=True) == 4
    stats = client.get_inference_statistics("accumulator")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 15
    config = client.get_model_config("accumulator")["sequence_batching"]
    assert config["state"][0]["input_name"] == "STATE_IN"
    assert "direct" in config


def test_grpc_unary_and_stream(run_appliance: Callable[..., Any], sequence_repo: Path) -> None:
    srv = run_appliance(sequence_repo)
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    values = [11, 7, 5, 3, 2, 0, 1]
    first, second = _interleaved(client, "accumulator")
    assert first == _expected(values)
    assert second == _expected([-v for v in values])

    # the stream, as simple_grpc_sequence_stream_infer_client drives it
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i, v in enumerate(values):
            for sid, sign in ((2000, 1), ("stream-b", -1)):
                client.async_stream_infer(
                    "accumulator",
                    [_input(grpcclient, sign * v)],
                    request_id=f"{sid}:{i}",
                    sequence_id=sid,
                    sequence_start=i == 0,
                    sequence_end=i == len(values) - 1,
                )
        got: dict[str, int] = {}
        for _ in range(2 * len(values)):
            result, error = results.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            got[response.id] = int(result.as_numpy("OUTPUT")[0, 0])
    finally:
        client.stop_stream()
    assert [got[f"2000:{i}"] for i in range(len(values))] == _expected(values)
    assert [got[f"stream-b:{i}"] for i in range(len(values))] == _expected([-v for v in values])


def test_control_inputs_reach_the_model(
    run_appliance: Callable[..., Any], sequence_repo: Path
) -> None:
    srv = run_appliance(sequence_repo)
    client = httpclient.InferenceServerClient(srv.url)

    def seen(model: str, sid: int | str, **flags: bool) -> dict[str, Any]:
        result = client.infer(
            model,
            [_input(httpclient, 1)],
            sequence_id=sid,
            **{f"sequence_{k}": v for k, v in flags.items()},
        )
        names = ("START_SEEN", "END_SEEN", "READY_SEEN", "CORRID_SEEN")
        return {n: result.as_numpy(n)[0, 0] for n in names}

    # START as FP32, END as INT32, READY as BOOL, CORRID as the uint64 id
    big = 2**63 - 5  # tritonclient's gRPC sends int64; over HTTP the JSON number is exact
    assert seen("controls", big, start=True) == {
        "START_SEEN": 1.0,
        "END_SEEN": 0,
        "READY_SEEN": True,
        "CORRID_SEEN": big,
    }
    assert seen("controls", big) == {
        "START_SEEN": 0.0,
        "END_SEEN": 0,
        "READY_SEEN": True,
        "CORRID_SEEN": big,
    }
    assert seen("controls", big, end=True)["END_SEEN"] == 1
    # a string id reaches a TYPE_STRING CORRID control as bytes
    assert seen("controls_string", "camera-7", start=True, end=True) == {
        "START_SEEN": 1.0,
        "END_SEEN": 1,
        "READY_SEEN": True,
        "CORRID_SEEN": b"camera-7",
    }


def test_sequence_errors_are_worded_as_tritons(
    run_appliance: Callable[..., Any], sequence_repo: Path
) -> None:
    srv = run_appliance(sequence_repo)
    http = httpclient.InferenceServerClient(srv.url)
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    for client in (http, grpc):
        with pytest.raises(InferenceServerException, match=START_ERROR) as info:
            _accumulate(client, "accumulator", 1, 424242)  # never started
        assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        _accumulate(client, "accumulator", 1, 77, start=True, end=True)
        with pytest.raises(InferenceServerException, match=START_ERROR):
            _accumulate(client, "accumulator", 1, 77)  # ended
        with pytest.raises(InferenceServerException, match="non-zero or non-empty correlation ID"):
            client.infer("accumulator", [_input(client, 1)])
        with pytest.raises(InferenceServerException, match="must specify batch-size 1"):
            client.infer(
                "accumulator", [_input(client, 1, rows=2)], sequence_id=5, sequence_start=True
            )
        with pytest.raises(InferenceServerException, match="integer correlation IDs"):
            client.infer("controls", [_input(client, 1)], sequence_id="text", sequence_start=True)
    failed = http.get_inference_statistics("accumulator")["model_stats"][0]["inference_stats"][
        "fail"
    ]
    assert failed["count"] == 8


def test_idle_sequences_are_released(run_appliance: Callable[..., Any], tmp_path: Path) -> None:
    srv = run_appliance(write_sequence_repository(tmp_path / "repo", idle_us=50_000))
    client = httpclient.InferenceServerClient(srv.url)
    assert _accumulate(client, "accumulator", 5, 9, start=True) == 5
    # each poll waits well past the idle limit, so the sequence is released at the
    # latest after the first pause without a request (a success only refreshes it)
    error = ""
    total = 5
    for _ in range(50):
        time.sleep(0.2)
        try:
            total = _accumulate(client, "accumulator", 1, 9)
        except InferenceServerException as exc:
            error = str(exc)
            break
    assert START_ERROR in error
    assert total >= 5
    # a new START on the same id begins again from the initial state
    assert _accumulate(client, "accumulator", 3, 9, start=True) == 3


def test_each_sequence_stays_on_its_instance(
    run_appliance: Callable[..., Any], tmp_path: Path
) -> None:
    srv = run_appliance(write_counter(tmp_path / "repo"))
    client = httpclient.InferenceServerClient(srv.url)

    def count(sid: int, value: int, via: Any = client, **flags: bool) -> tuple[int, int]:
        result = via.infer(
            "counter",
            [_input_1d(value)],
            sequence_id=sid,
            **{f"sequence_{k}": v for k, v in flags.items()},
        )
        return int(result.as_numpy("COUNT")[0]), int(result.as_numpy("INSTANCE")[0])

    a = [count(1, v, start=i == 0) for i, v in enumerate([1, 2, 3])]
    b = [count(2, v, start=i == 0) for i, v in enumerate([10, 20, 30])]
    a += [count(1, 4)]
    assert [c for c, _ in a] == [1, 3, 6, 10]  # the count lives in the instance
    assert [c for c, _ in b] == [10, 30, 60]
    assert len({i for _, i in a}) == 1 and len({i for _, i in b}) == 1
    assert a[0][1] != b[0][1]  # two instances, one slot each: one sequence per instance

    # both slots are held: a third sequence waits in the backlog until one ends
    third: queue.Queue[tuple[int, int]] = queue.Queue()

    def run_third() -> None:  # its own client: tritonclient's HTTP client is per thread
        other = httpclient.InferenceServerClient(srv.url)
        third.put(count(3, 100, other, start=True, end=True))

    waiter = threading.Thread(target=run_third)
    waiter.start()
    assert count(1, 5, end=True)[0] == 15
    waiter.join(30)
    assert third.get(timeout=1)[0] == 100
    assert count(2, 40, end=True) == (100, b[0][1])


def _input_1d(value: int) -> Any:
    tensor = httpclient.InferInput("INPUT", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], np.int32))
    return tensor


def test_direct_and_oldest_batch_across_sequences(
    run_appliance: Callable[..., Any], tmp_path: Path
) -> None:
    """Both models wait (up to 10 s) for a batch of two: the two requests sent
    together form it, so each strategy's batch is observable without timing."""
    srv = run_appliance(write_batching_repository(tmp_path / "repo"))
    client = httpclient.InferenceServerClient(srv.url, concurrency=2)

    def together(
        model: str, ids: tuple[int, int], values: tuple[int, int], **flags: bool
    ) -> list[Any]:
        pending = [
            client.async_infer(
                model,
                [_input(httpclient, v)],
                sequence_id=sid,
                **{f"sequence_{k}": f for k, f in flags.items()},
            )
            for sid, v in zip(ids, values, strict=True)
        ]
        return [p.get_result(timeout=60) for p in pending]

    # direct: slot i is batch row i; both rows ran in one batch of two
    rows = together("controls_batched", (31, 32), (1, 1), start=True)
    assert [int(r.as_numpy("ROWS")[0, 0]) for r in rows] == [2, 2]
    assert sorted(int(r.as_numpy("CORRID_SEEN")[0, 0]) for r in rows) == [31, 32]
    # oldest: two sequences' heads batched by preferred_batch_size 2, state per sequence
    first = together("accumulator_pairs", (41, 42), (5, 7), start=True)
    second = together("accumulator_pairs", (41, 42), (1, 2), end=True)
    assert [int(r.as_numpy("OUTPUT")[0, 0]) for r in first] == [5, 7]
    assert [int(r.as_numpy("OUTPUT")[0, 0]) for r in second] == [6, 9]
    stats = client.get_inference_statistics("accumulator_pairs")["model_stats"][0]
    assert [b["batch_size"] for b in stats["batch_stats"]] == [2]
    assert stats["execution_count"] == 2 and stats["inference_count"] == 4


def test_the_documented_example_runs(
    run_appliance: Callable[..., Any], sequence_repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/sequence-batching.md's client example, against its documented model."""
    (example,) = examples("sequence-batching.md", "test_the_documented_example_runs")
    srv = run_appliance(sequence_repo)
    assert (
        "sequence" in httpclient.InferenceServerClient(srv.url).get_server_metadata()["extensions"]
    )
    exec(example.replace("localhost:8000", srv.url), {})  # our own docs
    assert capsys.readouterr().out.split() == ["3", "7", "12"]


def test_in_process_api_takes_the_sequence_arguments(sequence_repo: Path) -> None:
    with InProcessServer(sequence_repo) as server:
        outs = [
            server.infer_blocking(
                "accumulator_oldest",
                {"INPUT": np.array([[v]], np.int32)},
                sequence_id="cam-1",
                sequence_start=i == 0,
                sequence_end=i == 2,
            )["OUTPUT"][0, 0]
            for i, v in enumerate([1, 2, 3])
        ]
    assert outs == [101, 103, 106]
