"""Ensembles end to end: the shipped image pipeline and DAGs over the ``simple`` model."""

from __future__ import annotations

import asyncio
import io
import struct
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from appliance.config.model_config import parse_model_config
from appliance.config.server_config import load_server_config
from appliance.config.triton_config import pbtxt_to_dict
from appliance.core.lifecycle import ModelLifeCycle
from devtools import modelgen


def encode(fmt: str, size: tuple[int, int] = (320, 240), seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def huge_png() -> bytes:
    """A valid small PNG whose header claims 100000 x 100000 pixels."""
    data = bytearray(encode("PNG", (8, 8)))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", 100_000, 100_000)
    crc = zlib.crc32(bytes(data[ihdr : ihdr + 17]))
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", crc)
    return bytes(data)


def _bytes_input(name: str, payloads: list[bytes]) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, [len(payloads), 1], "BYTES")
    tensor.set_data_from_numpy(np.array(payloads, dtype=object).reshape(-1, 1))
    return tensor


def _fp32_input(name: str, arr: np.ndarray) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(arr.shape), "FP32")
    tensor.set_data_from_numpy(arr)
    return tensor


def by_hand(client: httpclient.InferenceServerClient, image: bytes) -> tuple[np.ndarray, ...]:
    pixels = client.infer("preprocess", [_bytes_input("IMAGE", [image])]).as_numpy("PIXELS")
    probs = client.infer("classifier", [_fp32_input("input", pixels)]).as_numpy("output")
    labels = client.infer("postprocess", [_fp32_input("PROBS", probs)]).as_numpy("LABELS")
    return pixels, probs, labels


@pytest.fixture(scope="module")
def demo_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("demo")
    modelgen.write_demo_repository(repo)
    return repo


def test_image_pipeline_equals_its_steps_run_by_hand(run_appliance, demo_repository) -> None:
    srv = run_appliance(demo_repository)
    client = httpclient.InferenceServerClient(srv.url)
    for fmt, seed in (("JPEG", 1), ("PNG", 2)):
        image = encode(fmt, seed=seed)
        labels = client.infer("image_classifier", [_bytes_input("IMAGE", [image])])
        got = labels.as_numpy("LABELS")
        pixels, _, expected = by_hand(client, image)
        assert got.shape == (1, 5)
        assert got.tolist() == expected.tolist()
        # the preprocess step does what its description says
        rgb = Image.open(io.BytesIO(image)).convert("RGB").resize((224, 224), Image.BILINEAR)
        mean = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(3, 1, 1)
        std = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(3, 1, 1)
        want = (np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 255.0 - mean) / std
        np.testing.assert_allclose(pixels[0], want, rtol=1e-5, atol=1e-5)
        scores = [float(s.split(b":")[0]) for s in got[0]]
        assert scores == sorted(scores, reverse=True)
    metrics = urllib.request.urlopen(srv.metrics_url).read().decode()
    assert 'nv_inference_request_success{model="image_classifier",version="1"} 2' in metrics


def test_image_pipeline_batches_many_callers(run_appliance, demo_repository) -> None:
    srv = run_appliance(demo_repository)
    client = httpclient.InferenceServerClient(srv.url, concurrency=16)
    images = [encode("JPEG", (64 + i, 48 + i), seed=i) for i in range(32)]
    expected = [by_hand(client, im)[2].tolist() for im in images]

    pending = [
        client.async_infer("image_classifier", [_bytes_input("IMAGE", [im])]) for im in images
    ]
    got = [p.get_result().as_numpy("LABELS").tolist() for p in pending]
    assert got == expected
    stats = client.get_inference_statistics("image_classifier")["model_stats"][0]
    assert int(stats["inference_stats"]["success"]["count"]) == len(images)
    two = client.infer(
        "image_classifier", [_bytes_input("IMAGE", [images[0], images[1]])]
    ).as_numpy("LABELS")
    assert two.tolist() == [expected[0][0], expected[1][0]]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            b"definitely not an image",
            "not a readable JPEG or PNG image: 23 bytes in no image format "
            "(they start b'definite')",
        ),
        (encode("JPEG")[:600], "not a readable JPEG or PNG image"),
        (huge_png(), "image is too large"),
        (encode("GIF"), "expected a JPEG or PNG image, got GIF"),
    ],
    ids=["garbage", "truncated", "huge", "gif"],
)
def test_bad_images_are_a_clear_400_and_the_pipeline_keeps_serving(
    run_appliance, demo_repository, payload: bytes, message: str
) -> None:
    srv = run_appliance(demo_repository)
    client = httpclient.InferenceServerClient(srv.url)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("image_classifier", [_bytes_input("IMAGE", [payload])])
    assert raised.value.status() == "400"
    assert message in str(raised.value)
    assert " object at 0x" not in str(raised.value)  # no Python object's repr
    good = client.infer("image_classifier", [_bytes_input("IMAGE", [encode("PNG")])])
    assert good.as_numpy("LABELS").shape == (1, 5)


def _steps(*steps: str) -> str:
    return "ensemble_scheduling:\n  step:\n" + "".join(steps)


def _step(model: str, inputs: str, outputs: str) -> str:
    return (
        f"    - model_name: {model}\n      model_version: -1\n"
        f"      input_map: {{{inputs}}}\n      output_map: {{{outputs}}}\n"
    )


def _ensemble(inputs: str, outputs: str, steps: str) -> str:
    return f"platform: ensemble\nmax_batch_size: 8\ninput:\n{inputs}output:\n{outputs}{steps}"


INT_IN = (
    "  - {name: A, data_type: TYPE_INT32, dims: [16]}\n"
    "  - {name: B, data_type: TYPE_INT32, dims: [16]}\n"
)
# (A+B) + (A-B) and (A+B) - (A-B): two independent steps feed a third
DIAMOND = _ensemble(
    INT_IN,
    "  - {name: TWO_A, data_type: TYPE_INT32, dims: [16]}\n"
    "  - {name: TWO_B, data_type: TYPE_INT32, dims: [16]}\n",
    _steps(
        _step("simple", "INPUT0: sum, INPUT1: diff", "OUTPUT0: TWO_A, OUTPUT1: TWO_B"),
        _step("simple", "INPUT0: A, INPUT1: B", "OUTPUT0: sum"),
        _step("simple", "INPUT0: A, INPUT1: B", "OUTPUT1: diff"),
    ),
)


def _repo(tmp_path: Path, config: str) -> Path:
    modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
    (tmp_path / "pipe" / "1").mkdir(parents=True)
    (tmp_path / "pipe" / "config.yaml").write_text(config)
    return tmp_path


def test_a_diamond_dag_runs_in_dependency_order(run_appliance, tmp_path: Path) -> None:
    srv = run_appliance(_repo(tmp_path, DIAMOND))
    client = httpclient.InferenceServerClient(srv.url)
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), 5, dtype=np.int32)
    inputs = []
    for name, arr in (("A", a), ("B", b)):
        t = httpclient.InferInput(name, [2, 16], "INT32")
        t.set_data_from_numpy(arr)
        inputs.append(t)
    result = client.infer("pipe", inputs)
    np.testing.assert_array_equal(result.as_numpy("TWO_A"), 2 * a)
    np.testing.assert_array_equal(result.as_numpy("TWO_B"), 2 * b)
    config = client.get_model_config("pipe")
    assert config["platform"] == "ensemble"
    assert len(config["ensemble_scheduling"]["step"]) == 3
    simple = client.get_inference_statistics("simple")["model_stats"][0]["inference_stats"]
    assert int(simple["success"]["count"]) == 3  # each step went through the model


async def load_reason(repo: Path, model: str = "pipe") -> str:
    """Why ``model`` did not load when the repository started ("" when it did)."""
    server = load_server_config(None, {"model_repository": repo, "model_control_mode": "none"})
    lifecycle = ModelLifeCycle(repo, server)
    await lifecycle.start()
    try:
        return lifecycle.entry(model).reason
    finally:
        await lifecycle.stop(5)


ONE_OUT = "  - {name: OUT, data_type: TYPE_INT32, dims: [16]}\n"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            _ensemble(INT_IN, ONE_OUT, _steps(_step("nope", "INPUT0: A", "OUTPUT0: OUT"))),
            "step[0].model_name: Request for unknown model: 'nope' is not found",
        ),
        (
            _ensemble(INT_IN, ONE_OUT, _steps(_step("simple", "INPUT0: A", "OUTPUT0: OUT"))),
            "also needs input(s) ['INPUT1']",
        ),
        (
            _ensemble(
                INT_IN, ONE_OUT, _steps(_step("simple", "INPUT0: A, INPUT1: C", "OUTPUT0: OUT"))
            ),
            "tensor 'C' is neither an ensemble input nor a step output",
        ),
        (
            _ensemble(
                INT_IN, ONE_OUT, _steps(_step("simple", "INPUT0: A, INPUT9: B", "OUTPUT0: OUT"))
            ),
            "model 'simple' has no input 'INPUT9'",
        ),
        (
            _ensemble(
                "  - {name: A, data_type: TYPE_FP32, dims: [16]}\n"
                "  - {name: B, data_type: TYPE_INT32, dims: [16]}\n",
                ONE_OUT,
                _steps(_step("simple", "INPUT0: A, INPUT1: B", "OUTPUT0: OUT")),
            ),
            "tensor 'A' is FP32 [16] but model 'simple' input 'INPUT0' expects INT32 [16]",
        ),
        (
            _ensemble(
                INT_IN,
                ONE_OUT,
                _steps(
                    _step("simple", "INPUT0: A, INPUT1: y", "OUTPUT0: x"),
                    _step("simple", "INPUT0: x, INPUT1: B", "OUTPUT0: y, OUTPUT1: OUT"),
                ),
            ),
            "wait on each other's outputs (a cycle)",
        ),
        (
            _ensemble(
                INT_IN, ONE_OUT, _steps(_step("simple", "INPUT0: A, INPUT1: B", "OUTPUT0: Z"))
            ),
            "output 'OUT': no step produces this tensor",
        ),
    ],
    ids=[
        "unknown-model",
        "unmapped-input",
        "missing-tensor",
        "no-such-input",
        "dtype",
        "cycle",
        "unproduced-output",
    ],
)
def test_invalid_ensembles_are_config_errors(tmp_path: Path, config: str, message: str) -> None:
    reason = asyncio.run(load_reason(_repo(tmp_path, config)))
    assert message in reason
    assert "pipe/config.yaml" in reason


PBTXT = """
name: "pipe"
platform: "ensemble"
max_batch_size: 8
input [ { name: "A" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 16 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "simple"
      model_version: -1
      input_map { key: "INPUT0" value: "A" }
      input_map { key: "INPUT1" value: "A" }
      output_map { key: "OUTPUT0" value: "OUT" }
    }
  ]
}
"""


def test_pbtxt_ensemble_parses_like_yaml() -> None:
    config = parse_model_config(pbtxt_to_dict(PBTXT, "config.pbtxt"), "pipe", "config.pbtxt")
    assert config.platform == "ensemble"
    (step,) = config.ensemble_steps
    assert (step.model_name, step.model_version) == ("simple", -1)
    assert step.input_map == {"INPUT0": "A", "INPUT1": "A"}
    assert step.output_map == {"OUTPUT0": "OUT"}


def test_steps_without_platform_ensemble_are_rejected() -> None:
    data = {"backend": "onnxruntime", "ensemble_scheduling": {"step": []}}
    with pytest.raises(Exception, match="only a model with platform 'ensemble' has steps"):
        parse_model_config(data, "m", "m/config.yaml")
