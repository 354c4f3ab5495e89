"""The Jetson decoding pipeline docs/vision.md gives, run here against the real RTSP
server with the two NVIDIA elements swapped for their software equivalents
(``nvv4l2decoder`` -> ``openh264dec``, ``nvvidconv`` -> ``videoconvert``): the rest
(RTSP over TCP, depayloading, parsing, the RGBA caps, the one-frame appsink) is checked
as written."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from cameras import SYSTEM_PYTHON, RtspServer

ROOT = Path(__file__).resolve().parents[2]


def documented_pipeline() -> str:
    doc = (ROOT / "docs" / "vision.md").read_text()
    block = re.search(r"\n\n((?:    .*\n)+)", doc[doc.index("at the end of this pipeline") :])
    assert block is not None
    return " ".join(line.strip() for line in block.group(1).splitlines())


def test_the_documented_pipeline_delivers_rgba_frames() -> None:
    pipeline = documented_pipeline()
    assert "nvv4l2decoder" in pipeline and "max-buffers=1 drop=true" in pipeline
    server = RtspServer()  # skips without GStreamer's RTSP server (fails under CI)
    server.start()
    try:
        here = (
            pipeline.replace("rtsp://...", server.url)
            .replace("nvv4l2decoder", "openh264dec")
            .replace("nvvidconv", "videoconvert")
        )
        done = subprocess.run(
            [SYSTEM_PYTHON, str(ROOT / "tests" / "gst_pull.py"), here, "3"],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        )
    finally:
        server.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["320x240 RGBA 307200"] * 3
