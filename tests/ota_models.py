"""Releases of a real classifier for the OTA tests of sealed, delta and shadow-tested
bundles: an MLP (devtools.modelgen) whose versions are the same weights, one layer
retrained, or other weights altogether; self-test vectors computed by ONNX Runtime
in this process; and live traffic to the served model while the agent works."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import onnxruntime as ort
import urllib3

from appliance.ota import bundle, repo
from appliance.ota.rollout import Rollout
from devtools import modelgen
from tests.ota_helpers import Fleet

IN, HIDDEN = 64, 128
CONFIG = "max_batch_size: 8\n"
X = np.random.default_rng(11).standard_normal((1, IN)).astype(np.float32)


def weights(seed: int = 1, retrained: tuple[int, int] | None = None) -> bytes:
    return modelgen.mlp(IN, HIDDEN, 16, seed=seed, retrained=retrained)


def outputs(model: bytes, x: np.ndarray = X) -> np.ndarray:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    result: np.ndarray = session.run(None, {"input": x})[0]
    return result


def vectors(model: bytes) -> list[dict[str, Any]]:
    return [
        {
            "inputs": {"input": {"datatype": "FP32", "shape": [1, IN], "data": X[0].tolist()}},
            "outputs": {
                "output": {"datatype": "FP32", "shape": [1, 16], "data": outputs(model)[0].tolist()}
            },
            "tolerance": 1e-4,
        }
    ]


def release(
    fleet: Fleet,
    version: int,
    model: bytes,
    delta_from: tuple[Path, ...] = (),
    **build: Any,
) -> Path:
    """Bundle ``model`` as version ``version`` of ``m`` (``build``: bundle.build's
    shadow, seal_to, ...) and publish it; the bundle."""
    folder = modelgen.write_model(fleet.src, "m", model, CONFIG, version)
    out = fleet.root / f"m-{version}.bundle"
    bundle.build(folder, version, out, self_test=vectors(model), **build)
    repo.publish(fleet.repo, fleet.keys, out, Rollout(), delta_from=delta_from)
    return out


BODY = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, IN], "data": X[0].tolist()}]}


def served(url: str) -> tuple[str, np.ndarray]:
    """The version answering unversioned requests to ``m``, and its output."""
    r = urllib3.request("POST", f"{url}/v2/models/m/infer", json=BODY, retries=False)
    assert r.status == 200, r.data
    doc = r.json()
    return str(doc["model_version"]), np.asarray(doc["outputs"][0]["data"], np.float32)


class Traffic:
    """Unversioned requests to ``m`` from a thread while the agent works (what shadow
    probation mirrors), bounded in count and time."""

    def __init__(self, url: str, limit: int = 5000, limit_s: float = 120.0) -> None:
        self.url, self.limit, self.limit_s = url, limit, limit_s
        self.sent = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self.limit_s
        http = urllib3.PoolManager()
        while not self._stop.is_set() and self.sent < self.limit and time.monotonic() < deadline:
            r = http.request("POST", f"{self.url}/v2/models/m/infer", json=BODY, retries=False)
            self.sent += 1
            self.failed += r.status != 200
            self._stop.wait(0.005)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(30)
