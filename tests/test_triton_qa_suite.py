"""Triton's own server QA test files (``qa/L0_*`` of triton-inference-server/server),
run unchanged against the appliance, from a local copy.

Set ``TRITON_QA_DIR`` to the ``qa`` folder of a checkout of that repository (its
code is not part of this project). Without it every case skips. Each case copies or
generates the suite's models the way the suite's ``test.sh`` does (only suites whose
models need no GPU and no other backend), serves them on 127.0.0.1 at the ports
Triton's tests dial (8000 and 8001: a case skips when either is taken), and runs the
named unittest cases in the suite's folder, as ``test.sh`` runs them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

QA = os.environ.get("TRITON_QA_DIR", "")


def _copy_models(suite: str, skip: tuple[str, ...] = ()) -> Callable[[Path, Path], None]:
    """The suite ships its models (``<suite>/models``): copy them, less ``skip``."""

    def make(qa: Path, repo: Path) -> None:
        for model in (qa / suite / "models").iterdir():
            if model.name not in skip:
                shutil.copytree(model, repo / model.name)

    return make


def _generated(script: str, *args: str) -> Callable[[Path, Path], None]:
    """Models written by one of ``qa/common``'s generators, ONNX only."""

    def make(qa: Path, repo: Path) -> None:
        subprocess.run(
            [sys.executable, str(qa / "common" / script), "--models_dir", str(repo), *args],
            cwd=qa / "common",
            check=True,
            timeout=600,
        )

    return make


def _http_models(qa: Path, repo: Path) -> None:
    """L0_http's python unit test models, as its test.sh copies and edits them."""
    generated = repo.parent / "identity"
    generated.mkdir()
    _generated("gen_qa_identity_models.py", "--onnx")(qa, generated)
    for name in ("onnx_zero_1_float32", "onnx_zero_1_object", "onnx_zero_1_float16"):
        shutil.copytree(generated / name, repo / name)
    shutil.copytree(generated / "onnx_zero_3_float32", repo / "onnx_zero_3_float32")
    one = repo / "onnx_zero_1_object_1_element"
    shutil.copytree(repo / "onnx_zero_1_object", one)
    text = (one / "config.pbtxt").read_text().replace("onnx_zero_1_object", one.name)
    (one / "config.pbtxt").write_text(text.replace("-1", "1", 1))
    queue = repo / "onnx_zero_1_float32_queue"
    shutil.copytree(repo / "onnx_zero_1_float32", queue)
    text = (queue / "config.pbtxt").read_text().replace("onnx_zero_1_float32", queue.name)
    (queue / "config.pbtxt").write_text(
        text + "dynamic_batching { max_queue_delay_microseconds: 1000000 "
        "preferred_batch_size: [ 8 ] default_queue_policy { max_queue_size: 1 } }\n"
    )


def _decoupled_models(qa: Path, repo: Path) -> None:
    """L0_decoupled's ``python_models``: our own equivalents of the models its test.sh
    and Triton's QA image put there (python_backend's ``examples/decoupled``), a Python
    model in place of the libtorch one ``fan_repeat`` reads."""
    from tests.core.test_ensemble_decoupled import decoupled_repository

    decoupled_repository(repo)


def _parameters_models(qa: Path, repo: Path) -> None:
    """L0_parameters' ``model_repository`` (its ``parameter`` model and ``ensemble``),
    with a Python ``identity`` for Triton's identity backend."""
    for name in ("parameter", "ensemble"):
        shutil.copytree(qa / "L0_parameters" / "model_repository" / name, repo / name)
    (repo / "ensemble" / "1").mkdir(exist_ok=True)
    identity = repo / "identity"
    (identity / "1").mkdir(parents=True)
    (identity / "1" / "model.py").write_text(
        "import triton_python_backend_utils as pb_utils\n\n\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        return [\n"
        "            pb_utils.InferenceResponse(\n"
        '                [pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy())]\n'
        "            )\n"
        "            for r in requests\n"
        "        ]\n"
    )
    text = (qa / "L0_parameters" / "model_repository" / "identity" / "config.pbtxt").read_text()
    (identity / "config.pbtxt").write_text(text.replace('"identity"', '"python"'))


# suite folder, test file, unittest cases, how its models are made, server options
CASES = [
    (
        "L0_input_validation",
        "input_validation_test.py",
        ["InputValTest"],
        # pt_identity and the onnx_object models come from other generators
        _copy_models("L0_input_validation"),
        {},
    ),
    (
        "L0_http",
        "http_test.py",
        [
            f"HttpTest.{case}"
            for case in (
                "test_raw_binary",
                "test_raw_binary_longer",
                "test_byte",
                "test_byte_too_many_elements",
                "test_multi_variable_dimensions",
                "test_multi_inputs",
                "test_content_encoding_chunked_manually",
                "test_descriptive_status_code",
            )
        ],
        _http_models,
        {},
    ),
    (
        "L0_logging",
        "logging_endpoint_test.py",
        ["LogEndpointTest"],
        lambda qa, repo: None,  # no model needed
        {},
    ),
    (
        "L0_parameters",
        "parameters_test.py",
        [
            "InferenceParametersTest.test_params",
            "InferenceParametersTest.test_params_reserved_rejected",
        ],
        _parameters_models,
        {},
    ),
    # test_headers and test_grpc_header_forward_pattern_case_sensitive send a gRPC
    # header whose value ends with a space, which RFC 9113 calls malformed: the stream
    # is reset (docs/triton-compatibility.md); tests/test_triton_python_api.py has them
    (
        "L0_parameters",
        "parameters_test.py",
        ["InferenceParametersTest.test_headers_reserved_rejected"],
        _parameters_models,
        {"http_header_forward_pattern": ".*", "grpc_header_forward_pattern": ".*"},
    ),
    (
        "L0_decoupled",
        "decoupled_test.py",
        [
            f"DecoupledTest.{case}"
            for case in (
                "test_one_to_none",
                "test_one_to_one",
                "test_no_streaming",
                "test_wrong_shape",
            )
        ],
        _decoupled_models,
        {},
    ),
    (
        "L0_scalar_io",
        "scalar_test.py",
        ["ScalarIOTest"],
        _generated("gen_qa_ort_scalar_models.py"),
        {},
    ),
]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize(
    ("suite", "test_file", "cases", "make_models", "options"),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_tritons_qa_suite_passes(
    run_appliance,
    tmp_path: Path,
    suite: str,
    test_file: str,
    cases: list[str],
    make_models: Callable[[Path, Path], None],
    options: dict[str, object],
) -> None:
    if not QA:
        pytest.skip(
            "set TRITON_QA_DIR to the qa folder of a triton-inference-server/server checkout"
        )
    qa = Path(QA)
    if not (qa / suite / test_file).is_file():
        pytest.skip(f"{qa / suite / test_file} is not there")
    if not (_port_free(8000) and _port_free(8001)):
        pytest.skip("Triton's tests dial 127.0.0.1:8000 and :8001, and one is taken")
    repo = tmp_path / "models"
    repo.mkdir()
    make_models(qa, repo)
    run_appliance(repo, http_port=8000, grpc_port=8001, **options)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(qa / "common"), str(qa / suite)])}
    done = subprocess.run(
        [sys.executable, test_file, *cases],
        cwd=qa / suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
