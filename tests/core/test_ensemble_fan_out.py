"""Ensemble fan-out: a detector's variable number of crops fed to a batching
recogniser as its batch (split into chunks of its max_batch_size, batched in its own
batcher, gathered back in row order), with real ONNX models and a real server."""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from devtools import modelgen, ocr_models
from tests.core.test_ensemble import load_reason


def _repository(repo: Path, ocr_config: str = ocr_models.OCR_CONFIG) -> Path:
    modelgen.write_model(repo, "detector", ocr_models.detector(), ocr_models.DETECTOR_CONFIG)
    modelgen.write_model(repo, "recognizer", ocr_models.recognizer(), ocr_models.RECOGNIZER_CONFIG)
    (repo / "ocr" / "1").mkdir(parents=True)
    (repo / "ocr" / "config.yaml").write_text(ocr_config)
    return repo


def _by_hand(page: np.ndarray) -> dict[str, np.ndarray]:
    """The pipeline run in-process with ONNX Runtime, one crop at a time."""
    detector = ort.InferenceSession(ocr_models.detector())
    recognizer = ort.InferenceSession(ocr_models.recognizer())
    crops, lines = detector.run(None, {"page": page})
    rows = [recognizer.run(None, {"crop": crops[i : i + 1]}) for i in range(len(crops))]
    return {
        "lines": lines,
        "scores": np.concatenate([r[0] for r in rows]) if rows else np.empty((0, 4), np.float32),
        "labels": np.concatenate([r[1] for r in rows]) if rows else np.empty((0, 1), np.int64),
    }


def _ask(client: httpclient.InferenceServerClient, page: np.ndarray) -> dict[str, np.ndarray]:
    tensor = httpclient.InferInput("page", list(page.shape), "FP32")
    tensor.set_data_from_numpy(page)
    result = client.infer("ocr", [tensor])
    return {name: result.as_numpy(name) for name in ("lines", "labels", "scores")}


def test_crops_fan_out_to_the_batching_recogniser_in_row_order(
    run_appliance, tmp_path: Path
) -> None:
    srv = run_appliance(_repository(tmp_path))
    client = httpclient.InferenceServerClient(srv.url)
    # seven text lines of ten: two chunks of the recogniser's max_batch_size 4, then 3
    page = ocr_models.page([0, 2, 3, 5, 6, 7, 9], 10)
    want = _by_hand(page)
    assert len(set(want["labels"].ravel().tolist())) > 1  # rows that differ: order shows
    got = _ask(client, page)
    np.testing.assert_array_equal(got["lines"], [0, 2, 3, 5, 6, 7, 9])
    np.testing.assert_array_equal(got["labels"], want["labels"])
    np.testing.assert_allclose(got["scores"], want["scores"], rtol=1e-5, atol=1e-5)
    stats = client.get_inference_statistics("recognizer")["model_stats"][0]
    assert stats["inference_count"] == 7  # every crop went through the model's batcher
    assert int(stats["inference_stats"]["success"]["count"]) == 2  # as 4 + 3 rows

    # a page without text: no recogniser call, empty outputs of the declared shapes
    blank = _ask(client, ocr_models.page([], 3))
    assert blank["lines"].shape == (0,) and blank["labels"].shape == (0, 1)
    assert blank["scores"].shape == (0, 4)
    empty = httpclient.InferInput("page", [24, 16], "FP32")
    empty.set_data_from_numpy(ocr_models.page([], 3))
    assert client.infer("ocr", [empty]).get_output("scores")["datatype"] == "FP32"

    # many callers at once: each gets its own rows back, in its own order
    pages = [ocr_models.page(sorted({i % 5, (3 * i) % 9, 8}), 9, seed=i) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda p: _ask(httpclient.InferenceServerClient(srv.url), p), pages)
        )
    for p, answer in zip(pages, answers, strict=True):
        np.testing.assert_array_equal(answer["labels"], _by_hand(p)["labels"])

    # the same over gRPC
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    tensor = grpcclient.InferInput("page", list(page.shape), "FP32")
    tensor.set_data_from_numpy(page)
    np.testing.assert_array_equal(grpc.infer("ocr", [tensor]).as_numpy("labels"), want["labels"])


def test_more_rows_than_max_fan_out_is_refused_and_serving_goes_on(
    run_appliance, tmp_path: Path
) -> None:
    config = ocr_models.OCR_CONFIG + 'parameters: {max_fan_out: "5"}\n'
    srv = run_appliance(_repository(tmp_path, config))
    client = httpclient.InferenceServerClient(srv.url)
    with pytest.raises(InferenceServerException) as refused:
        _ask(client, ocr_models.page(list(range(6)), 6))
    assert refused.value.status() == "400"
    assert "6 rows to fan out, more than the 5 one request may" in str(refused.value)
    assert "parameters.max_fan_out" in str(refused.value)
    five = _ask(client, ocr_models.page(list(range(5)), 6))
    assert five["labels"].shape == (5, 1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (  # each batch item's rows: [batch, N, 8, 16] cannot be one batch
            lambda c: (
                "platform: ensemble\nmax_batch_size: 2\n"
                "input: [{name: crops, data_type: TYPE_FP32, dims: [-1, 8, 16]}]\n"
                "output: [{name: scores, data_type: TYPE_FP32, dims: [-1, 4]}]\n"
                "ensemble_scheduling:\n  step:\n"
                "    - {model_name: recognizer, input_map: {crop: crops}, "
                "output_map: {scores: scores}}\n"
            ),
            "fanning rows out to a step needs an ensemble that does not batch",
        ),
        (
            lambda c: c + 'parameters: {max_fan_out: "0"}\n',
            "parameters.max_fan_out: model 'ocr': parameters.max_fan_out: expected an "
            "integer >= 1, got '0'",
        ),
    ],
    ids=["batching-ensemble", "max-fan-out"],
)
def test_fan_out_configs_that_cannot_work_are_config_errors(
    tmp_path: Path, change, message: str
) -> None:
    reason = asyncio.run(load_reason(_repository(tmp_path, change(ocr_models.OCR_CONFIG)), "ocr"))
    assert message in reason
    assert "ocr/config.yaml" in reason


def _one_step_ensemble(repo: Path, tensors: dict[str, str], step: str) -> None:
    """``repo/ocr``: an ensemble of one step; ``tensors``: name -> "TYPE dims", the last
    one its output."""
    *inputs, output = (
        f"{{name: {n}, data_type: {t.split()[0]}, dims: {t.split(' ', 1)[1]}}}"
        for n, t in tensors.items()
    )
    (repo / "ocr" / "1").mkdir(parents=True)
    (repo / "ocr" / "config.yaml").write_text(
        f"platform: ensemble\nmax_batch_size: 0\ninput: [{', '.join(inputs)}]\n"
        f"output: [{output}]\nensemble_scheduling:\n  step:\n    - {step}\n"
    )


def test_rows_fan_out_only_to_a_batching_model_and_every_input_needs_them(
    tmp_path: Path,
) -> None:
    fixed = tmp_path / "fixed"  # a model of one fixed shape [4] cannot take N rows
    modelgen.write_model(fixed, "add", modelgen.no_batch_add((4,)))
    _one_step_ensemble(
        fixed,
        {"A": "TYPE_FP32 [-1, 4]", "B": "TYPE_FP32 [-1, 4]", "SUM": "TYPE_FP32 [-1, 4]"},
        "{model_name: add, input_map: {A: A, B: B}, output_map: {SUM: SUM}}",
    )
    reason = asyncio.run(load_reason(fixed, "ocr"))
    assert "its leading dim of rows can fan out only to a model that batches" in reason

    other = tmp_path / "mixed"
    modelgen.write_model(other, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
    _one_step_ensemble(
        other,
        {"A": "TYPE_INT32 [-1, 16]", "B": "TYPE_INT32 [16]", "OUT": "TYPE_INT32 [-1, 16]"},
        "{model_name: simple, input_map: {INPUT0: A, INPUT1: B}, output_map: {OUTPUT0: OUT}}",
    )
    reason = asyncio.run(load_reason(other, "ocr"))
    assert "gets the rows of ['INPUT0'] as its batch, but input(s) ['INPUT1']" in reason
