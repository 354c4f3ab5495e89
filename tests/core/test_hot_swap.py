"""Zero-downtime hot swap: versions swapped repeatedly under a running load generator.

Every response must come from either the old or the new copy (the versions are
MLPs with different weights, so their outputs tell them apart), no request may
fail, and once the old copies have unloaded the memory is back where it was.
"""

from __future__ import annotations

import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import tritonclient.http as httpclient
from http_helpers import post_json
from pace import scaled
from tritonclient.utils import InferenceServerException

from devtools import modelgen

X = np.random.default_rng(7).standard_normal((1, 1024)).astype(np.float32)


def _mlp(seed: int) -> bytes:
    return modelgen.mlp(1024, 1024, 16, seed=seed)


def _expected(model: bytes) -> np.ndarray:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    out: np.ndarray = session.run(None, {"input": X})[0]
    return out


def _put_version(folder: Path, version: int, model: bytes) -> None:
    """Write a version folder the way a careful publisher does: stage it under a
    hidden name, then rename it into place."""
    staging = folder / f".{version}.tmp"
    staging.mkdir()
    (staging / "model.onnx").write_bytes(model)
    staging.rename(folder / str(version))


class LoadGenerator:
    """``threads`` callers, each sending requests until ``stop`` is set (and at least
    ``min_count`` were sent), ``max_count`` were sent, or ``max_s`` passed."""

    def __init__(self, url: str, model: str, threads: int = 4) -> None:
        self.url, self.model = url, model
        self.stop = threading.Event()
        self.results: list[tuple[str, np.ndarray]] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self, min_count: int = 20, max_count: int = 3000, max_s: float = 90.0) -> None:
        client = httpclient.InferenceServerClient(self.url, network_timeout=30)
        deadline = time.monotonic() + max_s
        sent = 0
        while sent < max_count and time.monotonic() < deadline:
            if self.stop.is_set() and sent >= min_count:
                break
            sent += 1
            inp = httpclient.InferInput("input", [1, 1024], "FP32")
            inp.set_data_from_numpy(X, binary_data=True)
            try:
                result = client.infer(self.model, [inp])
            except InferenceServerException as exc:
                with self._lock:
                    self.errors.append(str(exc))
                continue
            version = str(result.get_response()["model_version"])
            with self._lock:
                self.results.append((version, result.as_numpy("output")))
        client.close()

    def __enter__(self) -> LoadGenerator:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(120)

    def count(self) -> int:
        with self._lock:
            return len(self.results) + len(self.errors)

    def wait_for_more(self, n: int) -> None:
        """Until ``n`` more requests were answered (traffic during a swap)."""
        target = self.count() + n
        _wait_for(lambda: self.count() >= target)


def _wait_for(condition: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + scaled(timeout)
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _settled(client: httpclient.InferenceServerClient) -> bool:
    """No copy is loading or draining any more."""
    index = client.get_model_repository_index()
    return all(row.get("state") in (None, "READY") for row in index)


def _used(client: httpclient.InferenceServerClient) -> int:
    stats = client.get_inference_statistics()["model_stats"]
    return sum(m["byte_size"] for s in stats for m in s["memory_usage"])


def _gauge(srv: Any, name: str) -> float:
    text = urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def _budget_used(srv: Any) -> float:
    return _gauge(srv, "appliance_memory_budget_used_bytes")


def test_versions_swap_under_load_without_a_failed_request(run_appliance, tmp_path: Path) -> None:
    # a small model first: ONNX Runtime's one-time start-up memory is charged to it
    modelgen.write_model(tmp_path, "a_first", modelgen.simple_add_sub())
    models = {v: _mlp(seed=v) for v in range(1, 6)}
    expected = {str(v): _expected(m) for v, m in models.items()}
    assert not np.allclose(expected["1"], expected["2"])  # the versions are told apart
    folder = modelgen.write_model(tmp_path, "m", models[1])
    srv = run_appliance(tmp_path, drain_timeout_s=30)
    client = httpclient.InferenceServerClient(srv.url)
    # one swap before measuring: the first leaves allocator state a steady state repeats
    _put_version(folder, 2, models[2])
    client.load_model("m")
    _wait_for(lambda: _settled(client))

    with LoadGenerator(srv.url, "m") as gen:
        _wait_for(lambda: gen.count() >= 50)
        _wait_for(lambda: _settled(client))
        for v in (3, 4, 5):
            _put_version(folder, v, models[v])  # a new version: latest {num_versions: 1}
            client.load_model("m")
            gen.wait_for_more(20)  # traffic meanwhile
        # a changed config for the same version: reloaded, swapped the same way
        (folder / "config.yaml").write_text("instance_group: [{count: 2}]\n")
        client.load_model("m")
        gen.wait_for_more(20)
        (folder / "config.yaml").write_text("instance_group: [{count: 1}]\n")
        client.load_model("m")
        gen.wait_for_more(20)

    assert gen.errors == []
    seen = {version for version, _ in gen.results}
    assert {"2", "5"} <= seen, seen
    for version, out in gen.results:
        np.testing.assert_allclose(out, expected[version], rtol=1e-5, atol=1e-6)
    _wait_for(lambda: _settled(client))
    # the old copies unloaded: their memory went back to the budget and to the OS
    assert client.get_model_repository_index()[1:] == [
        {"name": "m", "version": "5", "state": "READY", "reason": ""}
    ]
    # the budget holds exactly the copies serving now: every old copy's charge returned
    assert _budget_used(srv) == _used(client)


def _used_of(client: httpclient.InferenceServerClient, model: str) -> int:
    stats = client.get_inference_statistics(model)["model_stats"]
    return sum(m["byte_size"] for s in stats for m in s["memory_usage"])


def _room_for_one_copy(
    run_appliance: Any, repo: Path, small: int, copy: int
) -> tuple[Any, httpclient.InferenceServerClient]:
    """A server whose budget holds every model once and half a copy of "m" more, never
    two copies, as that server itself measured them. A probe's figure can differ
    from the budgeted server's (in a long test session a probe once measured the
    copy near zero), so the copy counts at least its file's size (its weights), the
    premise is checked on the server under test, and the limit is set again from
    that server's own figures when it does not hold (at most three servers)."""
    size = (repo / "m" / "1" / "model.onnx").stat().st_size
    copy = max(copy, size)
    for _ in range(3):
        srv = run_appliance(repo, memory_limit=f"{int(small + 1.5 * copy)}B")
        client = httpclient.InferenceServerClient(srv.url)
        if client.is_model_ready("m"):
            small_now, copy_now = _used_of(client, "a_first"), _used_of(client, "m")
            if 1.5 * copy - (small_now - small) - copy_now < copy_now:
                return srv, client
            small, copy = small_now, max(copy_now, size)
        else:
            copy = int(copy * 1.25)  # it did not fit: more room
        srv.stop()
    raise AssertionError(f"no budget held one copy of 'm' but not two ({small=}, {copy=})")


def test_a_swap_the_budget_cannot_hold_is_refused_unless_in_place(
    run_appliance, tmp_path: Path
) -> None:
    modelgen.write_model(tmp_path, "a_first", modelgen.simple_add_sub())
    folder = modelgen.write_model(tmp_path, "m", _mlp(seed=1))
    # measured as the budgeted server will measure: servers here run in this process,
    # and only the first one in a process is charged ONNX Runtime's one-time start-up
    # memory, so a probe that may be that first one is run and thrown away first
    for _ in range(2):
        probe = run_appliance(tmp_path)
        client = httpclient.InferenceServerClient(probe.url)
        small, copy = _used_of(client, "a_first"), _used_of(client, "m")
        probe.stop()
    srv, client = _room_for_one_copy(run_appliance, tmp_path, small, copy)
    shutil.copytree(folder / "1", folder / "2")
    status, body = post_json(f"http://{srv.url}/v2/repository/models/m/load", {})
    assert status == 400
    assert "the old and the new copy must fit the budget together" in body
    assert "in_place=true" in body and "memory budget is" in body
    assert client.get_model_repository_index()[1]["version"] == "1"  # still serving

    with LoadGenerator(srv.url, "m", threads=2) as gen:
        _wait_for(lambda: gen.count() >= 20)
        status, body = post_json(
            f"http://{srv.url}/v2/repository/models/m/load", {"parameters": {"in_place": True}}
        )
        assert status == 200, body
        gen.wait_for_more(20)
    # during the brief unavailability a caller gets 503 "not ready", never anything else
    assert all("not ready" in e for e in gen.errors), gen.errors
    assert {v for v, _ in gen.results} == {"1", "2"}
    assert client.get_model_repository_index()[1:] == [
        {"name": "m", "version": "2", "state": "READY", "reason": ""}
    ]
    # only the new copy is charged: the old one's memory went back to the budget
    assert _budget_used(srv) == _used(client)
