"""YOLO heads read as arrays (``appliance/vision/yolo.py``) against plain loops: both
layouts (v8: class scores; v5: objectness times class probability), both axis orders,
per-class NMS, the threshold and the limit; and the letterbox's way back to the frame."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.errors import ApplianceError
from appliance.vision import image, yolo


def head(layout: str, boxes: int, classes: int, seed: int) -> np.ndarray:
    """(1, boxes, attributes): clustered boxes so NMS has work to do."""
    rng = np.random.default_rng(seed)
    extra = 5 if layout == "yolov5" else 4
    out = rng.random((1, boxes, extra + classes), dtype=np.float32)
    centres = rng.integers(0, 4, boxes) * 80.0 + 40
    out[0, :, 0] = centres + rng.normal(0, 5, boxes)
    out[0, :, 1] = centres + rng.normal(0, 5, boxes)
    out[0, :, 2:4] = 40 + rng.random((boxes, 2)) * 20
    return out


def loops(out: np.ndarray, layout: str, threshold: float, iou: float, limit: int) -> list:
    extra = 5 if layout == "yolov5" else 4
    found = []
    for row in out[0]:
        k = int(np.argmax(row[extra:]))
        score = float(row[extra + k]) * (float(row[4]) if layout == "yolov5" else 1.0)
        if score >= threshold:
            cx, cy, w, h = (float(v) for v in row[:4])
            found.append((score, k, (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)))
    found.sort(key=lambda f: -f[0])
    kept: list = []
    for score, k, box in found:
        if len(kept) < limit and all(c != k or overlap(box, b) <= iou for _, c, b in kept):
            kept.append((score, k, box))
    return kept


def overlap(a: tuple, b: tuple) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return w * h / union if union > 0 else 0.0


@pytest.mark.parametrize("layout", ["yolov8", "yolov5"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("limit", [100, 3])
def test_detect_matches_plain_loops(layout: str, transposed: bool, limit: int) -> None:
    out = head(layout, 300, 3, seed=7)
    want = loops(out, layout, 0.3, 0.45, limit)
    given = out.transpose(0, 2, 1).copy() if transposed else out
    got = yolo.detect(given, layout, 0.3, 0.45, limit)
    assert len(want) >= 3 and len(got.scores) == len(want)
    assert got.classes.tolist() == [k for _, k, _ in want]
    np.testing.assert_allclose(got.scores, [s for s, _, _ in want], rtol=1e-6)
    np.testing.assert_allclose(got.xyxy, [b for _, _, b in want], atol=1e-3)


def test_nothing_above_the_threshold() -> None:
    got = yolo.detect(head("yolov8", 50, 2, 1), "yolov8", 1.5, 0.45, 10)
    assert got.scores.shape == (0,) and got.xyxy.shape == (0, 4)


def test_a_head_too_narrow_for_its_layout_is_refused() -> None:
    with pytest.raises(ApplianceError, match="attributes"):
        yolo.detect(np.zeros((1, 5, 100), np.float32), "yolov5", 0.1, 0.5, 10)
    with pytest.raises(ApplianceError, match="2 dims"):
        yolo.detect(np.zeros((1, 2, 5, 100), np.float32), "yolov8", 0.1, 0.5, 10)


@pytest.mark.parametrize("letterbox", ["center", "corner"])
def test_letterbox_round_trip(letterbox: str) -> None:
    frame = np.zeros((480, 640, 3), np.uint8)
    frame[100:200, 300:400] = 255  # a white square
    fitted, fit = image.fit(frame, 320, letterbox)
    ys, xs = np.nonzero(fitted[:, :, 0] > 128)
    box = np.array([[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]], np.float32)
    np.testing.assert_allclose(fit.to_frame(box), [[300, 100, 400, 200]], atol=2.5)
    assert fitted.shape == (320, 320, 3)
    assert fitted[0, 0, 0] == (114 if letterbox == "center" else 0)
