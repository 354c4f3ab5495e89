"""The ``vision:`` section of appliance.yaml: the detectors the DeepStack/CodeProject.AI
detection API (``/v1/vision/detection``, ``/v1/vision/custom/<name>``) and the camera
streams run, validated into :class:`VisionConfig`. See docs/vision.md for each field.

A detector is a model of the repository (a model, an ensemble or a Python model) whose
output is a YOLO head, and how to read it: the layout (``yolov8``: ``4 + classes``
attributes per box; ``yolov5``: ``5 + classes``, with an objectness score), the input
size when the model's dims are dynamic, how the image is fitted to it, and the default
thresholds."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.config.fields import ConfigError, Fields, existing_path, parse_size

LAYOUTS = ("yolov8", "yolov5")
LETTERBOX = ("center", "corner")


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    """One detector: a repository model and how its YOLO output is read."""

    name: str  # the name /v1/vision/custom/<name> and streams use
    model: str  # the repository model that runs it
    layout: str = "yolov8"  # yolov8 (no objectness) | yolov5 (objectness)
    input_size: int = 0  # the square side the image is fitted to; 0: the model's dims
    letterbox: str = "center"  # center: padded on both sides (Ultralytics); corner: right/bottom
    min_confidence: float = 0.4  # DeepStack's default when a request names none
    iou_threshold: float = 0.45  # NMS: a box overlapping a better one of its class by more goes
    max_detections: int = 100
    labels: Path | None = None  # a label file; None: the output's label_filename


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The ``vision:`` section."""

    detectors: dict[str, DetectorConfig] = field(default_factory=dict)
    default: str = ""  # the detector /v1/vision/detection runs
    max_image_pixels: int = 40_000_000  # a larger image is refused before it is decoded
    max_image_bytes: int = 20 * 2**20  # an upload larger than this is refused as it arrives


def _fraction(f: Fields, key: str, default: float) -> float:
    value = f.data.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        raise f.fail(key, f"expected a number from 0 to 1, got {value!r}")
    return float(value)


def _choice(f: Fields, key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = f.text(key, default)
    if value not in allowed:
        raise f.fail(key, f"expected one of {', '.join(allowed)}, got {value!r}")
    return value


def _detector(f: Fields, name: str, path: Path | None) -> DetectorConfig:
    f.check_keys(set(DetectorConfig.__slots__) - {"name"})
    model = f.file_name("model", "model name") or name
    size = f.integer("input_size", 0)
    if size > 8192:
        raise f.fail("input_size", f"expected at most 8192 pixels, got {size}")
    return DetectorConfig(
        name=name,
        model=model,
        layout=_choice(f, "layout", "yolov8", LAYOUTS),
        input_size=size,
        letterbox=_choice(f, "letterbox", "center", LETTERBOX),
        min_confidence=_fraction(f, "min_confidence", 0.4),
        iou_threshold=_fraction(f, "iou_threshold", 0.45),
        max_detections=max(1, min(f.integer("max_detections", 100, minimum=1), 10000)),
        labels=existing_path(f, "labels", path),
    )


def parse_vision(f: Fields, path: Path | None) -> VisionConfig | None:
    """The ``vision`` section, or None when it is absent (no detection API)."""
    v = f.sub("vision")
    if v is None:
        return None
    v.check_keys(set(VisionConfig.__slots__))
    raw: Any = v.data.get("detectors", {})
    if not isinstance(raw, dict) or not raw:
        raise v.fail("detectors", "expected a mapping of detector names to detectors")
    detectors: dict[str, DetectorConfig] = {}
    for name in raw:
        names = Fields(v.source, {"name": name}, v.at("detectors"))
        checked = names.file_name("name", "detector name")
        entry = Fields(v.source, raw[name] or {}, f"{v.at('detectors')}.{checked}")
        detectors[checked] = _detector(entry, checked, path)
    default = v.text("default", next(iter(detectors)))
    if default not in detectors:
        raise v.fail("default", f"names no detector of this section: {default!r}")
    pixels = v.integer("max_image_pixels", 40_000_000, minimum=1)
    size = v.data.get("max_image_bytes", "20MiB")
    max_bytes = parse_size(size, v.source, v.at("max_image_bytes"))
    if max_bytes < 1:
        raise ConfigError(v.source, v.at("max_image_bytes"), "expected a size of at least 1 byte")
    return VisionConfig(detectors, default, pixels, max_bytes)
