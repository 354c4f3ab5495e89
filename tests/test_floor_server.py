"""The Python floor of the benchmarks (benchmarks/floor_server.py) answers right: its
figures are those of a server that does the inference, checked here with Triton's own
HTTP client against ONNX Runtime in-process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import tritonclient.http as httpclient
from mosquitto import free_port

from devtools import modelgen

ROOT = Path(__file__).resolve().parent.parent


def test_the_floor_answers_kserve_binary_requests_as_onnx_runtime_does(tmp_path: Path) -> None:
    graph = modelgen.simple_add_sub()
    (tmp_path / "simple" / "1").mkdir(parents=True)
    (tmp_path / "simple" / "1" / "model.onnx").write_bytes(graph)
    port = free_port()
    floor = ROOT / "benchmarks" / "floor_server.py"
    proc = subprocess.Popen(
        [sys.executable, str(floor), str(tmp_path), "--http-port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if client.is_server_ready():
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, "the floor did not start in 60 s"
            time.sleep(0.1)
        metadata = client.get_model_metadata("simple")
        assert [i["name"] for i in metadata["inputs"]] == ["INPUT0", "INPUT1"]
        rng = np.random.default_rng(7)
        a, b = (rng.integers(-1000, 1000, (3, 16), dtype=np.int32) for _ in range(2))
        inputs = [httpclient.InferInput(n, [3, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(a, binary_data=True)
        inputs[1].set_data_from_numpy(b, binary_data=True)
        outputs = [
            httpclient.InferRequestedOutput(n, binary_data=True) for n in ("OUTPUT0", "OUTPUT1")
        ]
        result = client.infer("simple", inputs, outputs=outputs)
        expected = ort.InferenceSession(graph).run(None, {"INPUT0": a, "INPUT1": b})
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected[0])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), expected[1])
        stats = client.get_inference_statistics("simple")["model_stats"][0]
        assert stats["inference_count"] == 1
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)
