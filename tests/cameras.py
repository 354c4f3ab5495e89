"""Real camera sources for the stream tests, all on 127.0.0.1:

- :class:`RtspServer`: GStreamer's RTSP server (``tests/rtsp_serve.py``, run by Debian's
  python3 with python3-gi and gir1.2-gst-rtsp-server-1.0, which scripts/test.sh
  installs) serving an H.264 test pattern; stopped (or killed mid-stream) by its PID;
- :class:`MjpegServer`: an HTTP MJPEG camera (``multipart/x-mixed-replace`` JPEG
  frames, as IP cameras serve them) on a thread;
- :func:`h264_file`: an H.264 MP4 written with PyAV;
- :class:`Webhook`: a local webhook receiver that keeps what it is sent.

Without the RTSP parts the tests that need them skip, except under CI, where they fail.
"""

from __future__ import annotations

import http.server
import io
import os
import subprocess
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mosquitto import free_port
from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's: where python3-gi is installed
_PROBE = (
    "import gi; gi.require_version('Gst', '1.0'); gi.require_version('GstRtspServer', '1.0');"
    "from gi.repository import Gst, GstRtspServer; Gst.init(None);"
    "missing = [e for e in ('videotestsrc', 'x264enc', 'rtph264pay', 'openh264dec') "
    "if Gst.ElementFactory.find(e) is None]; print(' '.join(missing))"
)
_checked: list[str] = []

# a small Python detector (no download): one box per frame, class "bright" scored by
# the frame's mean brightness; UINT8 NHWC input
BRIGHT_CONFIG = """
backend: "python"
max_batch_size: 8
input [{name: "images", data_type: TYPE_UINT8, dims: [64, 64, 3]}]
output [{name: "output0", data_type: TYPE_FP32, dims: [6, 16], label_filename: "labels.txt"}]
dynamic_batching {max_queue_delay_microseconds: 1000}
"""
BRIGHT_MODEL = """
import numpy as np
from appliance import python_model as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "images").as_numpy()
            out = np.zeros((images.shape[0], 6, 16), np.float32)
            out[:, 0:4, 0] = [32, 32, 32, 32]
            out[:, 5, 0] = images.mean(axis=(1, 2, 3)) / 255  # class 1, by brightness
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("output0", out)]))
        return responses
"""


def require_rtsp() -> None:
    """Skips the calling test without GStreamer's RTSP server (fails under CI)."""
    if not _checked:
        why = ""
        if not os.access(SYSTEM_PYTHON, os.X_OK):
            why = f"{SYSTEM_PYTHON} not found"
        else:
            probe = subprocess.run(
                [SYSTEM_PYTHON, "-c", _PROBE], capture_output=True, text=True, timeout=60
            )
            if probe.returncode != 0:
                why = (probe.stderr.strip().splitlines() or ["gi failed"])[-1]
            elif probe.stdout.strip():
                why = f"GStreamer elements missing: {probe.stdout.strip()}"
        _checked.append(why)
    if _checked[0]:
        reason = (
            f"no RTSP server: {_checked[0]}; install Debian's python3-gi, "
            "gir1.2-gst-rtsp-server-1.0, gstreamer1.0-plugins-ugly and -bad (scripts/test.sh does)"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


class RtspServer:
    def __init__(self) -> None:
        require_rtsp()
        self.port = free_port()
        self.process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"rtsp://127.0.0.1:{self.port}/cam"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        self.process = subprocess.Popen(
            [SYSTEM_PYTHON, str(HERE / "rtsp_serve.py"), str(self.port)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()  # "ready" once it listens
        assert line == "ready", f"the RTSP server did not start: {line!r}"

    def kill(self) -> None:
        """Gone at once, mid-stream, as a camera losing power."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    stop = kill


def picture(number: int, width: int = 320, height: int = 240) -> Image.Image:
    """A frame with a moving drawn face (the detector's face class scores it)."""
    image = Image.new("RGB", (width, height), (60, 90, 120))
    draw = ImageDraw.Draw(image)
    cx, cy, r = 60 + (number * 7) % (width - 120), height // 2, 40
    draw.ellipse([cx - r, cy - r * 1.3, cx + r, cy + r * 1.3], fill=(224, 172, 140))
    for side in (-1, 1):
        draw.ellipse([cx + side * 20 - 6, cy - 16, cx + side * 20 + 6, cy - 8], fill=(40, 30, 30))
    draw.text((4, 4), str(number), fill=(255, 255, 255))
    return image


def jpeg(number: int) -> bytes:
    out = io.BytesIO()
    picture(number).save(out, format="JPEG", quality=85)
    return out.getvalue()


class MjpegServer:
    """``GET /`` answers an endless multipart/x-mixed-replace stream at ``fps``."""

    def __init__(self, fps: float = 10.0) -> None:
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "multipart/x-mixed-replace; boundary=frame")
                self.end_headers()
                number = 0
                try:
                    while not owner.closing.is_set() and number < 10_000:  # bounded
                        body = jpeg(number)
                        head = (
                            f"--frame\r\nContent-Type: image/jpeg\r\n"
                            f"Content-Length: {len(body)}\r\n\r\n"
                        )
                        self.wfile.write(head.encode() + body + b"\r\n")
                        self.wfile.flush()
                        number += 1
                        owner.closing.wait(1 / fps)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.closing = threading.Event()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def stop(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


def h264_file(
    path: Path, frames: int = 30, fps: int = 10, size: tuple[int, int] = (320, 240)
) -> Path:
    """An H.264 MP4 of ``frames`` pictures, written with PyAV."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.time_base = Fraction(1, fps)
        for number in range(frames):
            pixels = np.asarray(picture(number, *size))
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


class Webhook:
    """A webhook receiver on 127.0.0.1 keeping every POSTed body."""

    def __init__(self) -> None:
        owner = self
        self.bodies: list[bytes] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                owner.bodies.append(self.rfile.read(min(length, 2**20)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
