"""The vision: and streams: sections of appliance.yaml: what they read, and every
refusal naming its field."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from appliance.config.fields import ConfigError
from appliance.config.server_config import load_server_config

VISION = {"detectors": {"yolo": {"layout": "yolov5", "input_size": 640}}}
MQTT = {"host": "127.0.0.1"}


def test_what_the_sections_read(tmp_path: Path) -> None:
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"")
    config = load_server_config(
        None,
        {
            "vision": {**VISION, "max_image_bytes": "1MiB"},
            "mqtt": MQTT,
            "streams": [
                {"name": "door", "url": "rtsp://u:p@10.0.0.5/s1", "mqtt_topic": "cams/door"},
                {"name": "yard", "url": "http://10.0.0.6/mjpg", "webhook": "http://h/x"},
                {
                    "name": "clip",
                    "url": str(clip),
                    "loop": False,
                    "jsonl": str(tmp_path / "c.jsonl"),
                },
                {"name": "usb", "url": "/dev/video0", "fps": 2, "mqtt_topic": "cams/usb"},
            ],
        },
    )
    assert config.vision is not None
    yolo = config.vision.detectors["yolo"]
    assert (yolo.model, yolo.layout, yolo.input_size, yolo.letterbox) == (
        "yolo",
        "yolov5",
        640,
        "center",
    )
    assert config.vision.default == "yolo" and config.vision.max_image_bytes == 2**20
    kinds = {s.name: (s.kind, s.detector) for s in config.streams}
    assert kinds == {
        "door": ("rtsp", "yolo"),
        "yard": ("mjpeg", "yolo"),
        "clip": ("file", "yolo"),
        "usb": ("v4l2", "yolo"),
    }
    assert (
        load_server_config(None, {}).streams == () and load_server_config(None, {}).vision is None
    )


BAD: list[tuple[dict[str, Any], str]] = [
    ({"vision": {"detectors": {}}}, "vision.detectors: expected a mapping"),
    ({"vision": {"detectors": {"../x": {}}}}, "detector name"),
    ({"vision": {"detectors": {"y": {"layout": "yolov9"}}}}, "vision.detectors.y.layout"),
    ({"vision": {"detectors": {"y": {"min_confidence": 2}}}}, "min_confidence"),
    ({"vision": {"detectors": {"y": {"colour": 1}}}}, "unknown field"),
    ({"vision": {**VISION, "default": "other"}}, "vision.default"),
    ({"vision": {**VISION, "max_image_bytes": 5}}, "a size needs a unit"),
    (
        {"streams": [{"name": "a", "url": "rtsp://h/s", "jsonl": "/tmp/x"}]},
        "a detector of the vision: section",
    ),
    ({"vision": VISION, "streams": [{"name": "a", "url": "rtsp://h/s"}]}, "has no sink"),
    ({"vision": VISION, "streams": [{"name": "a/b", "url": "rtsp://h/s"}]}, "stream name"),
    (
        {"vision": VISION, "streams": [{"name": "a", "url": "rtsp://h/s", "mqtt_topic": "x"}]},
        "needs the server's mqtt",
    ),
    (
        {
            "vision": VISION,
            "mqtt": MQTT,
            "streams": [{"name": "a", "url": "rtsp://h/s", "mqtt_topic": "cams/#"}],
        },
        "wildcards",
    ),
    (
        {
            "vision": VISION,
            "streams": [{"name": "a", "url": "ftp://h/s", "kind": "rtsp", "webhook": "http://h/"}],
        },
        "rtsp/rtsps:// URL",
    ),
    (
        {"vision": VISION, "streams": [{"name": "a", "url": "/nope.mp4", "webhook": "http://h/"}]},
        "existing file",
    ),
    (
        {"vision": VISION, "streams": [{"name": "a", "url": "rtsp://h/s", "webhook": "file:///x"}]},
        "http:// or https://",
    ),
    (
        {
            "vision": VISION,
            "streams": [{"name": "a", "url": "rtsp://h/s", "fps": 0, "webhook": "http://h/"}],
        },
        "frames per second",
    ),
    (
        {
            "vision": VISION,
            "streams": [
                {"name": "a", "url": "rtsp://h/s", "decoder": "magic", "webhook": "http://h/"}
            ],
        },
        "decoder",
    ),
    (
        {
            "vision": VISION,
            "streams": [
                {"name": "a", "url": "rtsp://h/s", "webhook": "http://h/"},
                {"name": "a", "url": "rtsp://h/t", "webhook": "http://h/"},
            ],
        },
        "two streams are named",
    ),
    (
        {
            "vision": VISION,
            "streams": [{"name": "a", "url": "rtsp://h/s", "jsonl": "/no/such/dir/x.jsonl"}],
        },
        "its folder must exist",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[m for _, m in BAD])
def test_refusals_name_the_field(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_server_config(None, overrides)
