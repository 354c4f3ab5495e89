"""A real pretrained YOLO-class detector (YOLOv8n, as the nudenet wheel ships it) served
with no config, and with two instances, against ONNX Runtime in-process.

The model is fetched from its PyPI wheel on first use and cached
(``tests/real_models.py``); without network the tests skip. What is checked is what
a user sees: auto-complete from the graph alone (dynamic batch, image size left open),
and answers equal to ONNX Runtime's own on the same image with the same threads. Speed
is in ``benchmarks/bench_detector.py``, never asserted here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
from real_models import NUDENET, YOLOV8N, wheel

from appliance.core.instances import cpu_share


@pytest.fixture(scope="module")
def detector() -> Path:
    return wheel(NUDENET, (YOLOV8N,)) / YOLOV8N  # skips without network


def picture(size: int = 320) -> np.ndarray:
    """A camera-like frame: a gradient with a few solid shapes, NCHW in [0, 1]."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    img = np.stack([x, y, (x + y) / 2])
    img[:, 40:140, 60:120] = np.array([0.9, 0.2, 0.1])[:, None, None]
    img[:, 180:300, 200:260] = np.array([0.1, 0.7, 0.3])[:, None, None]
    return img[None].astype(np.float32)


def in_process(model: Path, image: np.ndarray, threads: int) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    session = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    return session.run(["output0"], {"images": image})[0]  # type: ignore[no-any-return]


def served(url: str, image: np.ndarray) -> np.ndarray:
    client = httpclient.InferenceServerClient(url)
    try:
        inp = httpclient.InferInput("images", list(image.shape), "FP32")
        inp.set_data_from_numpy(image, binary_data=True)
        out = httpclient.InferRequestedOutput("output0", binary_data=True)
        got = client.infer("yolo", [inp], outputs=[out]).as_numpy("output0")
        assert got is not None
        return got
    finally:
        client.close()


def _repository(tmp_path: Path, model: Path, config: str | None) -> Path:
    version = tmp_path / "repo" / "yolo" / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").symlink_to(model)
    if config is not None:
        (version.parent / "config.yaml").write_text(config)
    return tmp_path / "repo"


def test_served_with_no_config_answers_as_onnx_runtime(
    run_appliance: Any, detector: Path, tmp_path: Path
) -> None:
    srv = run_appliance(_repository(tmp_path, detector, None), allow_symlinked_models=True)
    client = httpclient.InferenceServerClient(srv.url)
    try:
        config = client.get_model_config("yolo")
    finally:
        client.close()
    # auto-complete from the graph: batched (its first dim is dynamic), the image size open
    assert config["max_batch_size"] > 0
    assert config["input"][0]["dims"] == [3, -1, -1]
    assert config["output"][0]["dims"][0] == 22  # 4 box coordinates + 18 class scores
    image = picture()
    got = served(srv.url, image)
    want = in_process(detector, image, cpu_share(1))
    assert got.shape == want.shape == (1, 22, 2100)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # a detector answers boxes: the best-scoring one lies inside the frame
    best = int(want[0, 4:].max(axis=0).argmax())
    cx, cy, w, h = want[0, :4, best]
    assert 0 <= cx <= 320 and 0 <= cy <= 320 and w > 0 and h > 0


def test_two_instances_answer_alike_at_another_image_size(
    run_appliance: Any, detector: Path, tmp_path: Path
) -> None:
    config = "backend: onnxruntime\ninstance_group: [{count: 2, kind: KIND_CPU}]\n"
    srv = run_appliance(_repository(tmp_path, detector, config), allow_symlinked_models=True)
    image = picture(256)  # another size: the graph takes any multiple of 32
    want = in_process(detector, image, cpu_share(1))
    for _ in range(3):
        np.testing.assert_allclose(served(srv.url, image), want, rtol=1e-4, atol=1e-4)
