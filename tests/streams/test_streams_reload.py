"""Streams follow the server: the real ``appliance serve`` started with a config file
whose ``streams:`` then changes, and a SIGHUP applies it (a stream added, one removed,
an unchanged one kept running); a config that no longer validates changes nothing;
SIGTERM stops every stream with the server. The detector is a small Python model (no
download), the sources H.264 files written with PyAV, the sink a JSON-lines file."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from cameras import BRIGHT_CONFIG, BRIGHT_MODEL, h264_file, wait_for
from serve_process import start_serve

pytest.importorskip("av", reason="PyAV is the streams extra: pip install 'appliance[streams]'")


def status(port: int) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/streams", timeout=10) as answer:
        return {s["name"]: s for s in json.loads(answer.read())["streams"]}


def test_sighup_applies_the_streams_section(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    (repo / "bright" / "1").mkdir(parents=True)
    (repo / "bright" / "1" / "model.py").write_text(BRIGHT_MODEL)
    (repo / "bright" / "config.pbtxt").write_text(BRIGHT_CONFIG)
    (repo / "bright" / "labels.txt").write_text("dark\nbright\n")
    clip = h264_file(tmp_path / "clip.mp4", frames=10, fps=10)

    def stream(name: str) -> dict[str, Any]:
        return {"name": name, "url": str(clip), "fps": 10, "jsonl": f"{name}.jsonl"}

    doc: dict[str, Any] = {
        "model_repository": "models",
        "vision": {"detectors": {"bright": {"min_confidence": 0.1}}},
        "streams": [stream("one"), stream("two")],
    }
    config = tmp_path / "appliance.yaml"
    config.write_text(yaml.safe_dump(doc))
    proc, port, lines = start_serve("--config", str(config), "--grpc-port", "-1")
    try:
        wait_for(lambda: status(port).keys() == {"one", "two"}, 30, "two streams")
        wait_for(lambda: status(port)["one"]["frames_published"] >= 3, 60, "one publishing")
        line = json.loads((tmp_path / "one.jsonl").read_text().splitlines()[0])
        assert line["stream"] == "one" and line["predictions"][0]["label"] == "bright"
        kept_before = status(port)["one"]["frames_decoded"]

        doc["streams"] = [stream("one"), stream("three")]
        config.write_text(yaml.safe_dump(doc))
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: status(port).keys() == {"one", "three"}, 30, "the reload")
        # "one" was unchanged: the same stream kept counting (not restarted at 0)
        assert status(port)["one"]["frames_decoded"] >= kept_before
        wait_for(lambda: (tmp_path / "three.jsonl").exists(), 30, "the new stream's output")

        config.write_text("streams: [{name: bad}]\n")  # no longer valid: nothing changes
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: any("config reload refused" in x for x in lines), 30, "the refusal")
        assert status(port).keys() == {"one", "three"}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert any("stopped" in x for x in lines)
