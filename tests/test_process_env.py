"""appliance/process_env.py: importing ``appliance`` switches the engines' call-outs off
for the whole process before any engine is imported (tests/test_no_egress.py proves
the effect on the network; these run anywhere, without root, in fresh interpreters).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance import process_env

MODEL = Path(process_env.__file__).parent / "demo_models" / "simple" / "1" / "model.onnx"


def _python(code: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in process_env.ENVIRONMENT and k != "CI" and not k.startswith("GITHUB")
    }
    env["HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def _files(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file())


def test_onnxruntime_imported_after_appliance_starts_no_uploader(tmp_path: Path) -> None:
    # ONNX Runtime 1.29+ writes its device id and event store into HOME the moment its
    # uploader starts (at import); with the opt-out it starts nothing
    done = _python(
        "import os, appliance, onnxruntime as ort\n"
        "assert os.environ['ORT_DISABLE_TELEMETRY'] == '1'\n"
        "assert os.environ['ORT_TELEMETRY_DISABLED'] == '1'\n"
        f"ort.InferenceSession({str(MODEL)!r}, providers=['CPUExecutionProvider'])\n",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert _files(tmp_path) == []
    assert "imported before appliance" not in done.stderr


def test_openvino_imported_after_appliance_uses_its_telemetry_stub(tmp_path: Path) -> None:
    pytest.importorskip("openvino", reason="the test extra installs OpenVINO")
    done = _python(
        "import sys, appliance, openvino\n"
        "import openvino.tools.ovc.telemetry_utils as t\n"
        "assert t.tm.__name__ == 'openvino.tools.ovc.telemetry_stub', t.tm\n"
        "assert sys.modules['openvino_telemetry'] is None\n",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert _files(tmp_path) == []  # no ~/intel/openvino_ga_cid


def test_an_engine_imported_first_is_reported(tmp_path: Path) -> None:
    done = _python("import onnxruntime, appliance\n", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "onnxruntime imported before appliance" in done.stderr


def test_apply_is_idempotent_and_keeps_what_is_blocked() -> None:
    process_env.apply()
    process_env.apply()
    for name, value in process_env.ENVIRONMENT.items():
        assert os.environ[name] == value
    for name in process_env.BLOCKED_MODULES:
        assert sys.modules.get(name, "absent") is None
