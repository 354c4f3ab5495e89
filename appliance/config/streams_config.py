"""The ``streams:`` section of appliance.yaml: cameras the server itself reads, runs a
detector of the ``vision:`` section on, and publishes detections from (docs/vision.md,
"Camera streams"). Validated into :class:`StreamConfig` items, one per stream."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from appliance.config.fields import Fields, parse_size, seconds
from appliance.config.mqtt_config import MqttConfig
from appliance.config.vision_config import VisionConfig

KINDS = ("rtsp", "mjpeg", "file", "v4l2")
DECODERS = ("pyav",)  # appliance/streams/decoder.py: the decoders this build has
_TOPIC_LEVEL = re.compile(r"[^+#\0/]+")


@dataclass(frozen=True, slots=True)
class StreamConfig:
    """One camera: where frames come from, what runs on them, where detections go."""

    name: str  # one path component: the metric label, the published "stream"
    url: str  # rtsp://, http(s):// (MJPEG), a file path, or a V4L2 device (/dev/videoN)
    kind: str = "rtsp"  # rtsp | mjpeg | file | v4l2 (from the url unless given)
    loop: bool = True  # a file source: start again at its end (false: once)
    detector: str = ""  # a detector of vision: ("": its default)
    fps: float = 5.0  # frames inferred per second at most; a file is read at this rate
    min_confidence: float | None = None  # None: the detector's
    mqtt_topic: str = ""  # publish on the server's mqtt: broker
    webhook: str = ""  # POST each frame's detections (JSON) here
    jsonl: Path | None = None  # append each frame's detections as a JSON line
    jsonl_max_bytes: int = 10 * 2**20  # then the file rolls over to <name>.1
    only_detections: bool = False  # publish only frames with at least one prediction
    decoder: str = "pyav"
    open_timeout_s: float = 10.0  # connecting, and the longest wait for one packet
    reconnect_min_s: float = 0.5  # the first retry after a failure; doubled up to max
    reconnect_max_s: float = 30.0


def _kind(f: Fields, url: str) -> str:
    if "kind" in f.data:
        kind = f.text("kind")
        if kind not in KINDS:
            raise f.fail("kind", f"expected one of {', '.join(KINDS)}, got {kind!r}")
        return kind
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("rtsp", "rtsps"):
        return "rtsp"
    if scheme in ("http", "https"):
        return "mjpeg"
    if url.startswith("/dev/video"):
        return "v4l2"
    return "file"


def _url(f: Fields, kind: str, url: str) -> str:
    scheme = urlsplit(url).scheme.lower()
    wanted = {"rtsp": ("rtsp", "rtsps"), "mjpeg": ("http", "https")}.get(kind)
    if wanted is not None and scheme not in wanted:
        raise f.fail("url", f"a {kind} source needs a {'/'.join(wanted)}:// URL, got {url!r}")
    if kind == "v4l2" and not re.fullmatch(r"/dev/video\d{1,3}", url):
        raise f.fail("url", f"a v4l2 source is a device /dev/videoN, got {url!r}")
    if kind == "file":
        path = Path(os.path.expanduser(url))
        if not path.is_file():
            raise f.fail("url", f"a file source needs an existing file, {url!r} is not one")
        return str(path)
    return url


def _topic(f: Fields) -> str:
    topic = f.text("mqtt_topic")
    if topic and (
        topic.startswith("$") or not all(_TOPIC_LEVEL.fullmatch(p) for p in topic.split("/"))
    ):
        raise f.fail(
            "mqtt_topic", f"expected an MQTT topic without wildcards or empty levels, got {topic!r}"
        )
    return topic


def _stream(
    f: Fields, path: Path | None, vision: VisionConfig | None, mqtt: MqttConfig | None
) -> StreamConfig:
    f.check_keys(set(StreamConfig.__slots__))
    name = f.file_name("name", "stream name")
    if not name:
        raise f.fail("name", "every stream needs a name")
    url = f.text("url")
    if not url or "\0" in url or len(url) > 2048:
        raise f.fail("url", f"expected a source URL or path, got {url!r}")
    kind = _kind(f, url)
    if vision is None:
        raise f.fail("detector", "streams run a detector of the vision: section, and there is none")
    detector = f.text("detector", vision.default)
    if detector not in vision.detectors:
        raise f.fail("detector", f"names no detector of vision: {detector!r}")
    fps = f.data.get("fps", 5.0)
    if not isinstance(fps, (int, float)) or isinstance(fps, bool) or not 0 < fps <= 120:
        raise f.fail("fps", f"expected frames per second from 0 to 120, got {fps!r}")
    confidence = f.data.get("min_confidence")
    if confidence is not None and (
        not isinstance(confidence, (int, float))
        or isinstance(confidence, bool)
        or not 0 <= confidence <= 1
    ):
        raise f.fail("min_confidence", f"expected a number from 0 to 1, got {confidence!r}")
    topic = _topic(f)
    if topic and mqtt is None:
        raise f.fail(
            "mqtt_topic", "publishing to MQTT needs the server's mqtt: section (the broker)"
        )
    webhook = f.text("webhook")
    if webhook and urlsplit(webhook).scheme not in ("http", "https"):
        raise f.fail("webhook", f"expected an http:// or https:// URL, got {webhook!r}")
    jsonl = f.text("jsonl")
    jsonl_path = None
    if jsonl:
        jsonl_path = Path(os.path.expanduser(jsonl))
        if path is not None and not jsonl_path.is_absolute():
            jsonl_path = path.parent / jsonl_path
        if not jsonl_path.parent.is_dir():
            raise f.fail("jsonl", f"its folder must exist: {str(jsonl_path.parent)!r}")
    if not (topic or webhook or jsonl_path):
        raise f.fail("name", f"stream {name!r} has no sink: give mqtt_topic, webhook and/or jsonl")
    decoder = f.text("decoder", "pyav")
    if decoder not in DECODERS:
        raise f.fail("decoder", f"expected one of {', '.join(DECODERS)}, got {decoder!r}")
    low = seconds(f, "reconnect_min_s", 0.5, 0.01)
    high = seconds(f, "reconnect_max_s", 30.0, low)
    max_bytes = parse_size(
        f.data.get("jsonl_max_bytes", "10MiB"), f.source, f.at("jsonl_max_bytes")
    )
    return StreamConfig(
        name=name,
        url=_url(f, kind, url),
        kind=kind,
        loop=f.flag("loop", True),
        detector=detector,
        fps=float(fps),
        min_confidence=None if confidence is None else float(confidence),
        mqtt_topic=topic,
        webhook=webhook,
        jsonl=jsonl_path,
        jsonl_max_bytes=max(4096, max_bytes),
        only_detections=f.flag("only_detections", False),
        decoder=decoder,
        open_timeout_s=seconds(f, "open_timeout_s", 10.0, 0.1),
        reconnect_min_s=low,
        reconnect_max_s=high,
    )


def parse_streams(
    f: Fields, path: Path | None, vision: VisionConfig | None, mqtt: MqttConfig | None
) -> tuple[StreamConfig, ...]:
    """The ``streams`` list (empty when absent)."""
    if f.data.get("streams") is None:
        return ()
    streams = tuple(_stream(e, path, vision, mqtt) for e in f.entries("streams"))
    seen: set[str] = set()
    for i, stream in enumerate(streams):
        if stream.name in seen:
            raise f.fail(f"streams[{i}].name", f"two streams are named {stream.name!r}")
        seen.add(stream.name)
    return streams
