"""The DeepStack / CodeProject.AI detection API served by a real pretrained detector
(the YOLOv8n the nudenet wheel ships, fetched and cached by ``tests/real_models.py``),
called as Frigate's ``deepstack`` plugin calls it (``requests``: ``data={"api_key"}``,
``files={"image": jpeg}``), checked against the same model run in-process with
ONNX Runtime and a plain-loop decoding written here; and hostile uploads."""

from __future__ import annotations

import http.client
import io
import json
import re
import socket
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import onnxruntime as ort
import pytest
import requests
import yaml
from PIL import Image, ImageDraw
from real_models import NUDENET, YOLOV8N, wheel

from appliance.config.server_config import load_server_config

LABELS = [f"class_{i}" for i in range(18)]
CONFIG = """
backend: "onnxruntime"
max_batch_size: 4
input [{name: "images", data_type: TYPE_FP32, dims: [3, 320, 320]}]
output [{name: "output0", data_type: TYPE_FP32, dims: [22, 2100], label_filename: "labels.txt"}]
dynamic_batching {}
"""
TOKEN = "frigate-secret"
LOW = 0.003  # the drawn faces score 0.003-0.05: a handful of boxes to compare


@pytest.fixture(scope="module")
def model() -> Path:
    return wheel(NUDENET, (YOLOV8N,)) / YOLOV8N  # skips without network


@pytest.fixture(scope="module")
def repository(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("vision")
    folder = repo / "yolo"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(model.read_bytes())
    (folder / "config.pbtxt").write_text(CONFIG)
    (folder / "labels.txt").write_text("\n".join(LABELS) + "\n")
    return repo


VISION = {
    "default": "yolo",
    "max_image_pixels": 30_000_000,
    "max_image_bytes": "2MiB",
    "detectors": {
        "yolo": {"model": "yolo", "layout": "yolov8", "input_size": 320},
        "corner": {"model": "yolo", "input_size": 320, "letterbox": "corner"},
    },
}


@pytest.fixture
def running(run_appliance: Callable[..., Any], repository: Path) -> Any:
    return run_appliance(repository, vision=VISION, inference_token=TOKEN, grpc_port=-1)


@pytest.fixture
def server(running: Any) -> str:
    return f"http://{running.url}"


def frame(width: int, height: int, seed: int = 0, faces: int = 6) -> bytes:
    """A JPEG as Frigate sends one: a few drawn faces (the model's FACE_FEMALE class
    scores them 0.005-0.05: boxes enough to compare, none above DeepStack's 0.4)."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), (60, 90, 120))
    draw = ImageDraw.Draw(image)
    for _ in range(faces):
        r = int(rng.integers(max(2, width // 14), max(3, width // 8)))
        cx = int(rng.integers(r, max(r + 1, width - r)))
        cy = int(rng.integers(2 * r, max(2 * r + 1, height - 2 * r)))
        draw.ellipse([cx - r, cy - r * 1.3, cx + r, cy + r * 1.3], fill=(224, 172, 140))
        for side in (-1, 1):
            ex, ey = cx + side * r * 0.5, cy - r * 0.3
            draw.ellipse([ex - 8, ey - 6, ex + 8, ey + 6], fill=(40, 30, 30))
        draw.rectangle([cx - r * 0.4, cy + r * 0.5, cx + r * 0.4, cy + r * 0.6], fill=(150, 60, 60))
        draw.pieslice(
            [cx - r * 1.1, cy - r * 1.6, cx + r * 1.1, cy - r * 0.2], 180, 360, (70, 40, 20)
        )
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def reference(model: Path, jpeg: bytes, threshold: float, corner: bool) -> list[dict[str, Any]]:
    """The model run in-process, decoded and suppressed by plain loops."""
    img = Image.open(io.BytesIO(jpeg)).convert("RGB")
    w, h = img.size
    r = min(320 / w, 320 / h)
    nw, nh = round(w * r), round(h * r)
    canvas = Image.new("RGB", (320, 320), (0, 0, 0) if corner else (114, 114, 114))
    px, py = (0, 0) if corner else ((320 - nw) // 2, (320 - nh) // 2)
    canvas.paste(img.resize((nw, nh), Image.Resampling.BILINEAR), (px, py))
    x = (np.asarray(canvas, np.float32) / 255).transpose(2, 0, 1)[None]
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    out = session.run(None, {"images": x})[0][0].T  # (boxes, 22)
    found = []
    for row in out:
        k = int(np.argmax(row[4:]))
        score = float(row[4 + k])
        if score >= threshold:
            cx, cy, bw, bh = (float(v) for v in row[:4])
            found.append((score, k, [cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2]))
    found.sort(key=lambda f: -f[0])
    kept: list[tuple[float, int, list[float]]] = []
    for score, k, box in found:
        if all(c != k or iou(box, b) <= 0.45 for _, c, b in kept):
            kept.append((score, k, box))
    result = []
    for score, k, (x1, y1, x2, y2) in kept:
        xs = [min(max((v - px) / r, 0), w) for v in (x1, x2)]
        ys = [min(max((v - py) / r, 0), h) for v in (y1, y2)]
        result.append(
            {"label": LABELS[k], "confidence": score, "box": [xs[0], ys[0], xs[1], ys[1]]}
        )
    return result


def iou(a: list[float], b: list[float]) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def post(url: str, **kw: Any) -> requests.Response:
    with requests.Session() as session:  # as Frigate's plugin: one session, form + file
        return session.post(url, timeout=30, **kw)


@pytest.mark.parametrize(
    ("size", "route"),
    [((640, 480), "detection"), ((300, 500), "custom"), ((1280, 720), "detection")],
)
def test_frigate_call_matches_the_model_in_process(
    server: str, model: Path, size: tuple[int, int], route: str
) -> None:
    jpeg = frame(*size)
    url = f"{server}/v1/vision/" + ("detection" if route == "detection" else "custom/corner")
    answer = post(url, data={"api_key": TOKEN, "min_confidence": str(LOW)}, files={"image": jpeg})
    assert answer.status_code == 200, answer.text
    doc = answer.json()
    assert doc["success"] is True
    got = doc["predictions"]
    want = reference(model, jpeg, LOW, corner=route == "custom")
    assert len(want) >= 3  # the comparison compares something
    # boxes within a rounding of the threshold may flip between thread counts: compare
    # the clear ones, best first
    clear = [p for p in want if p["confidence"] > LOW * 1.05]
    assert [p["label"] for p in got[: len(clear)]] == [p["label"] for p in clear]
    for mine, theirs in zip(got, clear, strict=False):  # got may hold more
        assert mine["confidence"] == pytest.approx(theirs["confidence"], abs=1e-4)
        corners = [mine["x_min"], mine["y_min"], mine["x_max"], mine["y_max"]]
        assert corners == pytest.approx(theirs["box"], abs=1.01)
        assert 0 <= mine["x_min"] <= mine["x_max"] <= size[0]
        assert 0 <= mine["y_min"] <= mine["y_max"] <= size[1]
    assert doc["count"] == len(got)


def test_default_threshold_and_bearer_header(server: str) -> None:
    jpeg = frame(320, 240, seed=3)
    answer = post(
        f"{server}/v1/vision/detection",
        headers={"Authorization": f"Bearer {TOKEN}"},
        files={"image": ("frame.jpg", jpeg, "image/jpeg")},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["predictions"] == []  # noise scores below DeepStack's 0.4


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height pixels, in a few bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


HOSTILE: list[tuple[str, dict[str, Any], int, str]] = [
    ("not an image", {"files": {"image": b"GIF89a but not really"}}, 400, "not a JPEG"),
    ("100 MP png", {"files": {"image": png_header_only(10000, 10000)}}, 400, "pixels"),
    ("30.25 MP png", {"files": {"image": png_header_only(5500, 5500)}}, 400, "max_image_pixels"),
    ("truncated jpeg", {"files": {"image": frame(256, 256)[:2000]}}, 400, "broken"),
    ("missing image", {"files": {"picture": frame(64, 64)}}, 400, "'image'"),
    ("empty image", {"files": {"image": b""}}, 400, "empty"),
    (
        "bad confidence",
        {"files": {"image": frame(8, 8)}, "data": {"min_confidence": "nan"}},
        400,
        "min_confidence",
    ),
    (
        "not multipart",
        {"data": b"image=abc", "headers": {"Content-Type": "text/plain"}},
        400,
        "multipart",
    ),
    ("too big", {"files": {"image": b"\xff" * (3 * 2**20)}}, 413, "max_image_bytes"),
    (
        "too many fields",
        {"files": {f"f{i}": b"x" for i in range(20)} | {"image": b"x"}},
        400,
        "more than 16 fields",
    ),
    ("huge api_key", {"data": {"api_key": "k" * 5000}, "files": {"image": b"x"}}, 413, "api_key"),
]


@pytest.mark.parametrize(("case", "kw", "status", "needle"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_uploads_get_deepstack_errors(
    server: str, case: str, kw: dict[str, Any], status: int, needle: str
) -> None:
    data = kw.pop("data", {})
    if isinstance(data, dict):
        data = {"api_key": TOKEN, **data}
    answer = post(f"{server}/v1/vision/detection", data=data, **kw)
    assert answer.status_code == status, answer.text
    doc = answer.json()
    assert doc["success"] is False
    assert needle in doc["error"]


def test_oversize_part_is_refused_as_it_arrives(server: str) -> None:
    """A chunked body (no Content-Length) with an image past the limit: refused once the
    part passes it, not after buffering the whole."""

    def body() -> Any:
        yield b'--b\r\nContent-Disposition: form-data; name="image"; filename="x"\r\n\r\n'
        for _ in range(64):  # 4 MiB offered; the limit is 2 MiB
            yield b"\0" * 65536
        yield b"\r\n--b--\r\n"

    answer = post(
        f"{server}/v1/vision/detection?",
        data=body(),
        headers={
            "Content-Type": "multipart/form-data; boundary=b",
            "Authorization": f"Bearer {TOKEN}",
        },
    )
    assert answer.status_code == 413
    assert answer.json()["success"] is False


def test_the_fronts_own_refusals_come_in_deepstacks_shape(server: str) -> None:
    """A declared body over the server's max_request_size is refused by the front
    before the route reads it: still in DeepStack's shape, which its clients read."""
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/vision/detection")
    conn.putheader("Content-Type", "multipart/form-data; boundary=b")
    conn.putheader("Content-Length", str(2**40))
    conn.endheaders()
    answer = conn.getresponse()
    doc = json.loads(answer.read())
    conn.close()
    assert answer.status == 413
    assert doc["success"] is False and doc["code"] == 413
    assert "max_request_size" in doc["error"]


def test_wrong_or_missing_key_and_unknown_model(server: str) -> None:
    jpeg = frame(64, 64)
    wrong = post(f"{server}/v1/vision/detection", data={"api_key": "guess"}, files={"image": jpeg})
    assert wrong.status_code == 401
    assert wrong.json()["success"] is False
    missing = post(f"{server}/v1/vision/detection", files={"image": jpeg})
    assert missing.status_code == 401
    unknown = post(
        f"{server}/v1/vision/custom/nope", data={"api_key": TOKEN}, files={"image": jpeg}
    )
    assert unknown.status_code == 404
    assert "nope" in unknown.json()["error"]


def test_a_model_unloaded_and_loaded_again(running: Any, server: str) -> None:
    """Without its model the API answers DeepStack's error (never a 500); once the model
    is back, the detector reads its new config and serves again."""
    url, jpeg = f"{server}/v1/vision/detection", frame(320, 240)
    running.call(running.server.dataplane.unload_model("yolo"))
    gone = post(url, data={"api_key": TOKEN}, files={"image": jpeg})
    assert gone.status_code in (404, 503) and gone.json()["success"] is False
    assert "yolo" in gone.json()["error"]
    running.call(running.server.dataplane.load_model("yolo"))
    back = post(url, data={"api_key": TOKEN, "min_confidence": str(LOW)}, files={"image": jpeg})
    assert back.status_code == 200 and back.json()["predictions"]


# ---- docs/vision.md: every block checked -----------------------------------------------

DOC = (Path(__file__).resolve().parents[2] / "docs" / "vision.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", DOC, re.S | re.M)


def _yaml(title: str) -> list[Any]:
    return [
        yaml.safe_load(body)
        for kind, body in BLOCKS
        if kind == "yaml" and body.startswith(f"# {title}")
    ]


def test_every_doc_block_is_a_known_kind() -> None:
    assert {kind for kind, _ in BLOCKS} == {"yaml", "json", "python"}
    titles = [body.splitlines()[0] for kind, body in BLOCKS if kind == "yaml"]
    assert all(t.startswith(("# appliance.yaml", "# frigate", "# home assistant")) for t in titles)


def test_doc_configs_load_and_agree(tmp_path: Path) -> None:
    servers = []
    for i, body in enumerate(
        b for k, b in BLOCKS if k == "yaml" and b.startswith("# appliance.yaml")
    ):
        path = tmp_path / f"appliance{i}.yaml"
        path.write_text(body)
        servers.append(load_server_config(path, {}))
    assert len(servers) == 2
    vision = servers[0].vision
    assert vision is not None and vision.detectors["yolo"].model == "yolov8n"
    streams = {s.name: s for s in servers[1].streams}
    assert [s.kind for s in streams.values()] == ["rtsp", "mjpeg", "v4l2"]
    (frigate,) = _yaml("frigate")
    detector = frigate["detectors"]["appliance"]
    assert detector["type"] == "deepstack" and detector["api_key"] == servers[0].inference_token
    assert urlsplit(detector["api_url"]).path == "/v1/vision/detection"
    assert urlsplit(detector["api_url"]).port == 8000 == servers[0].http_port
    deepstack, sensor = _yaml("home assistant")
    (camera,) = deepstack["image_processing"]
    assert camera["platform"] == "deepstack_object" and camera["port"] == 8000
    assert (
        camera["custom_model"] in vision.detectors
        and camera["api_key"] == servers[0].inference_token
    )
    assert sensor["mqtt"]["sensor"][0]["state_topic"] == streams["front-door"].mqtt_topic


def test_doc_answer_shapes_are_what_is_sent(server: str) -> None:
    answer_doc, message_doc = (json.loads(b) for k, b in BLOCKS if k == "json")
    sent = post(
        f"{server}/v1/vision/detection", data={"api_key": TOKEN}, files={"image": frame(64, 64)}
    )
    assert set(answer_doc) == set(sent.json())
    assert set(answer_doc["predictions"][0]) == {
        "label",
        "confidence",
        "x_min",
        "y_min",
        "x_max",
        "y_max",
    }
    from appliance.streams.sinks import message

    assert set(message_doc) == set(json.loads(message("s", "d", 1, 0.0, 0.0, [])))


def test_doc_python_snippet_runs(server: str, tmp_path: Path) -> None:
    (code,) = (b for k, b in BLOCKS if k == "python")
    code = code.replace("http://127.0.0.1:8000", server).replace("my-nvr-key", TOKEN)
    (tmp_path / "cat.jpg").write_bytes(frame(320, 240))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True [")


def test_a_wrong_key_is_refused_before_the_image_is_read(server: str) -> None:
    """The api_key part comes first, as clients send it; the image part never ends.
    The answer (401) comes while the body is still incomplete."""
    host, port = urlsplit(server).hostname, urlsplit(server).port
    head = (
        b'--b\r\nContent-Disposition: form-data; name="api_key"\r\n\r\nguess\r\n'
        b'--b\r\nContent-Disposition: form-data; name="image"; filename="x.jpg"\r\n\r\n'
    )
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/vision/detection HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: multipart/form-data; boundary=b\r\n"
            b"Content-Length: 1000000\r\n\r\n" + head + b"\xff\xd8" * 1000
        )
        answer = sock.recv(65536)
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 401 Unauthorized"
    assert b'"success":false' in rest
