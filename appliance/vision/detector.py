"""A configured detector: an RGB frame in, DeepStack-shaped predictions out, through
the data plane (the model's own scheduler batches frames from every caller: the
detection API and the camera streams alike).

What the model takes is read from its loaded config on each call (a hot swap or a
reload may change it): the first input (``[3, S, S]`` NCHW or ``[S, S, 3]`` NHWC,
FP32/FP16 scaled to 0..1, or UINT8), the first output (the YOLO head), and the labels
(the detector's ``labels`` file, else the output's ``label_filename``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from appliance.config.model_config import ModelConfig
from appliance.config.vision_config import DetectorConfig, VisionConfig
from appliance.core.dataplane import DataPlane
from appliance.errors import invalid, not_found
from appliance.request import InferenceRequest
from appliance.vision import image, yolo

if TYPE_CHECKING:
    from PIL import Image

DATATYPES = ("FP32", "FP16", "UINT8")


@dataclass(frozen=True, slots=True)
class Plan:
    """How one loaded model config is fed and read."""

    input: str
    output: str
    datatype: str
    size: int
    channels_first: bool
    batched: bool
    labels: tuple[str, ...]


def _labels(path: Path) -> tuple[str, ...]:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return tuple(line.strip() for line in lines if line.strip())


def plan(config: ModelConfig, detector: DetectorConfig) -> Plan:
    """The plan for ``config``; INVALID_ARG naming what does not fit a detector."""
    where = f"detector '{detector.name}' (model '{config.name}')"
    if not config.inputs or not config.outputs:
        raise invalid(f"{where}: the model declares no inputs or outputs")
    tensor, output = config.inputs[0], config.outputs[0]
    dims = tensor.dims
    if len(dims) != 3 or tensor.datatype not in DATATYPES:
        raise invalid(
            f"{where}: its input '{tensor.name}' must be an image, [3, S, S] or [S, S, 3] "
            f"of {', '.join(DATATYPES)}; it is {tensor.datatype} {list(dims)}"
        )
    channels_first = dims[0] == 3 or (dims[0] == -1 and dims[2] != 3)
    sides = dims[1:] if channels_first else dims[:2]
    size = detector.input_size
    if size == 0:
        if sides[0] != sides[1] or sides[0] < 1:
            raise invalid(
                f"{where}: its input's sides are {list(sides)}; set input_size to the square "
                f"side the model takes"
            )
        size = sides[0]
    elif any(s not in (-1, size) for s in sides):
        raise invalid(f"{where}: input_size {size} does not fit its input dims {list(dims)}")
    labels = _labels(detector.labels) if detector.labels is not None else output.labels
    return Plan(
        tensor.name,
        output.name,
        tensor.datatype,
        size,
        channels_first,
        config.batch_size > 0,
        labels,
    )


class Detector:
    """One detector of the ``vision:`` section, served through ``dataplane``."""

    def __init__(self, dataplane: DataPlane, config: DetectorConfig) -> None:
        self.dataplane = dataplane
        self.config = config
        self._planned: tuple[ModelConfig, Plan] | None = None  # the last config and its plan

    def plan(self) -> Plan:
        """The plan for the version serving now (NOT_FOUND/UNAVAILABLE when none)."""
        config = self.dataplane.lifecycle.get(self.config.model, "").config
        if self._planned is None or self._planned[0] is not config:
            self._planned = (config, plan(config, self.config))
        return self._planned[1]

    def prepare(self, frame: Image.Image | np.ndarray, p: Plan) -> tuple[np.ndarray, image.Fit]:
        """The model input for ``frame`` (blocking: run it off the event loop)."""
        hwc, fit = image.fit(frame, p.size, self.config.letterbox)
        tensor = image.to_input(hwc, p.datatype, p.channels_first)
        return (tensor if p.batched else tensor[0]), fit

    def read(
        self, head: np.ndarray, fit: image.Fit, p: Plan, min_confidence: float | None
    ) -> list[dict[str, Any]]:
        """DeepStack predictions from the model's output (blocking)."""
        c = self.config
        threshold = c.min_confidence if min_confidence is None else min_confidence
        boxes = yolo.detect(
            head if p.batched else head[None],
            c.layout,
            threshold,
            c.iou_threshold,
            c.max_detections,
        )
        corners = np.rint(fit.to_frame(boxes.xyxy)).astype(np.int64).tolist()
        labels = p.labels
        return [
            {
                "label": labels[k] if k < len(labels) else str(k),
                "confidence": score,
                "x_min": box[0],
                "y_min": box[1],
                "x_max": box[2],
                "y_max": box[3],
            }
            for box, score, k in zip(
                corners, boxes.scores.tolist(), boxes.classes.tolist(), strict=True
            )
        ]

    async def detect(
        self, frame: Image.Image | np.ndarray, min_confidence: float | None = None
    ) -> list[dict[str, Any]]:
        """Predictions for one RGB frame, in its pixels, best first."""
        p = self.plan()
        tensor, fit = await asyncio.to_thread(self.prepare, frame, p)
        request = InferenceRequest(self.config.model, {p.input: tensor}, outputs=(p.output,))
        response = await self.dataplane.infer(request, "the vision API")
        head = response.outputs[p.output]
        return await asyncio.to_thread(self.read, head, fit, p, min_confidence)


class Detectors:
    """Every detector of the ``vision:`` section, by name."""

    def __init__(self, dataplane: DataPlane, config: VisionConfig) -> None:
        self.config = config
        self._by_name = {n: Detector(dataplane, d) for n, d in config.detectors.items()}

    def get(self, name: str = "") -> Detector:
        found = self._by_name.get(name or self.config.default)
        if found is None:
            raise not_found(f"no detector named {name!r}; this server has {sorted(self._by_name)}")
        return found
