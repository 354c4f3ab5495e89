"""Camera streams served by the appliance, with real parts on 127.0.0.1: GStreamer's RTSP
server (H.264 test pattern), an HTTP MJPEG camera, an H.264 file; the real YOLOv8n
(nudenet wheel) as the detector; detections on a real mosquitto, a local webhook and a
JSON-lines file. The RTSP server is killed mid-stream and comes back; a model slower
than the cameras makes the streams drop frames, counted."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cameras import MjpegServer, RtspServer, Webhook, h264_file, wait_for
from mosquitto import Broker, Client, require_mosquitto
from real_models import NUDENET, YOLOV8N, wheel

pytest.importorskip("av", reason="PyAV is the streams extra: pip install 'appliance[streams]'")

YOLO_CONFIG = """
backend: "onnxruntime"
max_batch_size: 4
input [{name: "images", data_type: TYPE_FP32, dims: [3, 320, 320]}]
output [{name: "output0", data_type: TYPE_FP32, dims: [22, 2100]}]
dynamic_batching {max_queue_delay_microseconds: 2000}
"""
SLOW_CONFIG = """
backend: "python"
max_batch_size: 4
input [{name: "images", data_type: TYPE_FP32, dims: [3, 64, 64]}]
output [{name: "output0", data_type: TYPE_FP32, dims: [6, 16]}]
dynamic_batching {max_queue_delay_microseconds: 1000}
"""
SLOW_MODEL = '''
import time
import numpy as np
from appliance import python_model as pb_utils


class TritonPythonModel:
    """A detector slower than any camera: 0.3 s a batch, one box per image."""

    def execute(self, requests):
        time.sleep(0.3)
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "images").as_numpy()
            out = np.zeros((images.shape[0], 6, 16), np.float32)
            out[:, 0:4, 0] = [32, 32, 16, 16]  # cx, cy, w, h
            out[:, 4, 0] = 0.9  # class 0
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("output0", out)]))
        return responses
'''


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = wheel(NUDENET, (YOLOV8N,)) / YOLOV8N  # skips without network
    repo = tmp_path_factory.mktemp("streams")
    (repo / "yolo" / "1").mkdir(parents=True)
    (repo / "yolo" / "1" / "model.onnx").write_bytes(model.read_bytes())
    (repo / "yolo" / "config.pbtxt").write_text(YOLO_CONFIG)
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(SLOW_MODEL)
    (repo / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    return repo


VISION = {
    "detectors": {
        # min_confidence 0: every frame has predictions (at most 3) to publish
        "yolo": {"min_confidence": 0.0, "max_detections": 3},
        "slow": {"model": "slow", "min_confidence": 0.5},
    }
}


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    b = Broker(require_mosquitto(), tmp_path_factory.mktemp("mosquitto"))
    b.start()
    yield b
    b.stop()


@pytest.fixture
def rtsp() -> Iterator[RtspServer]:
    server = RtspServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def mjpeg() -> Iterator[MjpegServer]:
    server = MjpegServer(fps=10)
    yield server
    server.stop()


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.stop()


@pytest.fixture
def subscriber(broker: Broker) -> Iterator[Client]:
    client = Client(broker.port)
    client.subscribe("cameras/#")
    yield client
    client.close()


def status(url: str) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(f"http://{url}/v1/streams", timeout=10) as answer:
        return {s["name"]: s for s in json.loads(answer.read())["streams"]}


def test_rtsp_mjpeg_and_file_streams_publish_detections(
    run_appliance: Callable[..., Any],
    repository: Path,
    broker: Broker,
    rtsp: RtspServer,
    mjpeg: MjpegServer,
    webhook: Webhook,
    subscriber: Client,
    tmp_path: Path,
) -> None:
    video = h264_file(tmp_path / "clip.mp4", frames=20, fps=10)
    lines = tmp_path / "file.jsonl"
    streams = [
        {"name": "door", "url": rtsp.url, "fps": 5, "mqtt_topic": "cameras/door"},
        {"name": "yard", "url": mjpeg.url, "fps": 5, "webhook": webhook.url},
        {
            "name": "clip",
            "url": str(video),
            "fps": 10,
            "loop": False,
            "jsonl": str(lines),
            "mqtt_topic": "cameras/clip",
        },
    ]
    running = run_appliance(
        repository,
        vision=VISION,
        streams=streams,
        mqtt={"host": "127.0.0.1", "port": broker.port},
        grpc_port=-1,
    )
    door = subscriber.collect(3, timeout=60, topic="cameras/door")
    for reply in door:
        doc = json.loads(reply.payload)
        assert doc["stream"] == "door" and doc["detector"] == "yolo"
        assert doc["timestamp"] > 1.7e9 and doc["latency_ms"] >= 0
        assert 1 <= len(doc["predictions"]) <= 3
        box = doc["predictions"][0]
        assert 0 <= box["x_min"] <= box["x_max"] <= 320 and 0 <= box["y_min"] <= box["y_max"] <= 240
    wait_for(lambda: len(webhook.bodies) >= 3, 60, "three webhook posts from the MJPEG camera")
    posted = json.loads(webhook.bodies[0])
    assert posted["stream"] == "yard" and posted["predictions"]
    wait_for(lambda: status(running.url)["yard"]["sinks"]["webhook"]["sent"] >= 3, 10, "sent")
    assert status(running.url)["yard"]["sinks"]["webhook"]["failed"] == 0
    # the file plays once: 20 frames at most, each inferred unless a newer one replaced it
    wait_for(
        lambda: (
            status(running.url)["clip"]["connected"] is False
            and status(running.url)["clip"]["frames_decoded"] == 20
        ),
        60,
        "the file to end",
    )
    clip = status(running.url)["clip"]
    assert clip["frames_inferred"] + clip["frames_dropped"] + clip["frames_failed"] == 20
    wait_for(lambda: len(lines.read_text().splitlines()) == clip["frames_published"], 10, "jsonl")
    numbers = [json.loads(line)["frame"] for line in lines.read_text().splitlines()]
    assert numbers == sorted(numbers) and set(numbers) <= set(range(1, 21))
    every = status(running.url)
    assert every["door"]["connected"] and every["yard"]["connected"]
    with urllib.request.urlopen(running.metrics_url, timeout=10) as answer:
        page = answer.read().decode()
    assert 'appliance_stream_frames_total{outcome="published",stream="door"}' in page
    assert 'appliance_stream_connected{stream="yard"} 1.0' in page


def test_rtsp_camera_lost_and_back_while_others_keep_publishing(
    run_appliance: Callable[..., Any],
    repository: Path,
    broker: Broker,
    rtsp: RtspServer,
    subscriber: Client,
    tmp_path: Path,
) -> None:
    video = h264_file(tmp_path / "loop.mp4", frames=10, fps=10)
    streams = [
        {
            "name": "door",
            "url": rtsp.url,
            "fps": 5,
            "mqtt_topic": "cameras/door",
            "open_timeout_s": 2,
            "reconnect_min_s": 0.2,
            "reconnect_max_s": 1,
        },
        {"name": "loop", "url": str(video), "fps": 5, "mqtt_topic": "cameras/loop"},
    ]
    running = run_appliance(
        repository,
        vision=VISION,
        streams=streams,
        mqtt={"host": "127.0.0.1", "port": broker.port},
        grpc_port=-1,
    )
    subscriber.collect(2, timeout=60, topic="cameras/door")
    rtsp.kill()  # the camera loses power mid-stream
    wait_for(lambda: not status(running.url)["door"]["connected"], 30, "the loss to be seen")
    lost = status(running.url)["door"]
    assert lost["disconnects"] >= 1 and lost["last_error"]
    # meanwhile the other stream keeps publishing
    while not subscriber.replies.empty():
        subscriber.replies.get_nowait()
    subscriber.collect(3, timeout=30, topic="cameras/loop")
    rtsp.start()  # back on the same port
    wait_for(lambda: status(running.url)["door"]["connected"], 60, "the reconnect")
    back = subscriber.collect(2, timeout=60, topic="cameras/door")
    assert json.loads(back[-1].payload)["stream"] == "door"
    assert status(running.url)["door"]["connects"] >= 2


def test_a_slow_model_drops_old_frames_and_counts_them(
    run_appliance: Callable[..., Any], repository: Path, tmp_path: Path
) -> None:
    """Two 20 fps files on a detector taking 0.3 s a batch: each stream holds one frame
    waiting and one in inference, never more; every other frame is dropped and counted."""
    streams = []
    for name in ("a", "b"):
        video = h264_file(tmp_path / f"{name}.mp4", frames=40, fps=20)
        streams.append(
            {
                "name": name,
                "url": str(video),
                "fps": 20,
                "loop": False,
                "detector": "slow",
                "jsonl": str(tmp_path / f"{name}.jsonl"),
            }
        )
    running = run_appliance(repository, vision=VISION, streams=streams, grpc_port=-1)
    for name in ("a", "b"):
        wait_for(lambda n=name: status(running.url)[n]["frames_decoded"] == 40, 60, "40 frames")

    # the last frames are taken once the model is free: wait for the slot to empty
    def settled() -> bool:
        s = status(running.url)
        return all(
            s[n]["frames_inferred"] + s[n]["frames_dropped"] + s[n]["frames_failed"] == 40
            for n in ("a", "b")
        )

    wait_for(settled, 30, "the last frames to be inferred")
    for name in ("a", "b"):
        s = status(running.url)[name]
        assert s["frames_dropped"] > 0 and 0 < s["frames_inferred"] < 40, s["last_error"]
        published = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        assert len(published) == s["frames_published"] == s["frames_inferred"]
        doc = json.loads(published[0])
        assert doc["predictions"][0]["label"] == "0"  # no label file: the class index
        assert doc["predictions"][0]["confidence"] == pytest.approx(0.9)
