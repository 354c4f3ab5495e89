"""Reading a YOLO detection head: candidate boxes, their best class and score, the
confidence threshold and per-class non-maximum suppression, all as array operations.

Two layouts (named by the detector's config):

- ``yolov8`` (Ultralytics v8/v11 exports): each candidate is ``cx, cy, w, h`` and one
  score per class (``4 + classes`` attributes), the score the class score;
- ``yolov5`` (v5/v7 exports): ``cx, cy, w, h, objectness`` and one probability per
  class (``5 + classes``), the score objectness times the class probability.

The attributes may lie on either axis (v8 exports ``(1, 4 + classes, boxes)``, v5
``(1, boxes, 5 + classes)``): the shorter axis is taken for the attributes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from appliance.errors import invalid


@dataclass(frozen=True, slots=True)
class Boxes:
    """Detections, best first: corners (n, 4: x1, y1, x2, y2), scores (n,), classes (n,)."""

    xyxy: np.ndarray
    scores: np.ndarray
    classes: np.ndarray


def candidates(output: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One image's head (its batch row) as corners (n, 4), scores (n,) and classes (n,)."""
    head = output[0] if output.ndim == 3 else output
    if head.ndim != 2:
        raise invalid(f"a YOLO head has 2 dims per image, got shape {list(output.shape)}")
    extra = 5 if layout == "yolov5" else 4
    if head.shape[0] < head.shape[1]:
        head = head.T  # (boxes, attributes): a view
    if head.shape[1] <= extra:
        raise invalid(
            f"a {layout} head has more than {extra} attributes per box, got shape "
            f"{list(output.shape)}"
        )
    scores_all = head[:, extra:]
    classes = scores_all.argmax(axis=1)
    scores = np.take_along_axis(scores_all, classes[:, None], axis=1)[:, 0]
    if layout == "yolov5":
        scores = scores * head[:, 4]
    half = head[:, 2:4] / 2
    xyxy = np.concatenate((head[:, 0:2] - half, head[:, 0:2] + half), axis=1)
    return xyxy.astype(np.float32, copy=False), scores.astype(np.float32), classes


def nms(xyxy: np.ndarray, scores: np.ndarray, iou: float, limit: int) -> np.ndarray:
    """Indices of the boxes greedy NMS keeps, best first (at most ``limit``)."""
    order = np.argsort(-scores, kind="stable")
    x1, y1, x2, y2 = xyxy[:, 0], xyxy[:, 1], xyxy[:, 2], xyxy[:, 3]
    areas = np.maximum(x2 - x1, 0) * np.maximum(y2 - y1, 0)
    keep: list[int] = []
    while order.size and len(keep) < limit:
        best, rest = order[0], order[1:]
        keep.append(int(best))
        w = np.minimum(x2[best], x2[rest]) - np.maximum(x1[best], x1[rest])
        h = np.minimum(y2[best], y2[rest]) - np.maximum(y1[best], y1[rest])
        inter = np.maximum(w, 0) * np.maximum(h, 0)
        union = areas[best] + areas[rest] - inter
        overlap = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
        order = rest[overlap <= iou]
    return np.asarray(keep, np.intp)


def detect(output: np.ndarray, layout: str, threshold: float, iou: float, limit: int) -> Boxes:
    """Boxes scoring at least ``threshold``, after per-class NMS (boxes of different
    classes never suppress each other), best first, at most ``limit``."""
    xyxy, scores, classes = candidates(output, layout)
    chosen = np.flatnonzero(scores >= threshold)
    xyxy, scores, classes = xyxy[chosen], scores[chosen], classes[chosen]
    if scores.size == 0:
        return Boxes(xyxy, scores, classes)
    # per-class NMS in one pass: each class's boxes moved apart from every other's
    offset = classes[:, None].astype(np.float32) * (float(np.abs(xyxy).max()) * 2 + 1)
    keep = nms(xyxy + offset, scores, iou, limit)
    return Boxes(xyxy[keep], scores[keep], classes[keep])
