"""Repository control over HTTP: index, unload, load, reload with a new version."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from appliance.core import repository
from devtools import modelgen


def _infer(client: httpclient.InferenceServerClient, model: str, version: str = "") -> str:
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(np.ones((1, 16), np.int32))
    result = client.infer(model, inputs, model_version=version)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2))
    return str(result.get_response()["model_version"])


def test_unload_and_load_again(run_appliance, tmp_path: Path) -> None:
    modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url)
    assert _infer(client, "simple") == "1"
    client.unload_model("simple")
    assert not client.is_model_ready("simple")
    with pytest.raises(InferenceServerException, match="not ready"):
        _infer(client, "simple")
    index = client.get_model_repository_index()
    assert index == [{"name": "simple", "state": "UNAVAILABLE", "reason": "unloaded"}]
    client.load_model("simple")
    assert client.is_model_ready("simple") and _infer(client, "simple") == "1"
    with pytest.raises(InferenceServerException, match="not in the model repository"):
        client.load_model("nope")


def test_reload_picks_up_a_new_version_and_policy(run_appliance, tmp_path: Path) -> None:
    folder = modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url)
    shutil.copytree(folder / "1", folder / "2")
    client.load_model("simple")
    assert _infer(client, "simple") == "2"  # no version asked: the newest ready one
    with pytest.raises(InferenceServerException, match="version 1 is not found"):
        _infer(client, "simple", "1")  # latest {num_versions: 1} serves only version 2
    (folder / "config.yaml").write_text("version_policy: {all: {}}\n")
    client.load_model("simple")
    assert _infer(client, "simple", "1") == "1" and _infer(client, "simple", "2") == "2"
    assert client.get_model_metadata("simple")["versions"] == ["1", "2"]
    stats = client.get_inference_statistics("simple")["model_stats"]
    assert [s["version"] for s in stats] == ["1", "2"]


def test_a_failed_reload_keeps_the_old_copy_serving(run_appliance, tmp_path: Path) -> None:
    folder = modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url)
    (folder / "config.yaml").write_text("max_batch_size: [oops]\n")
    with pytest.raises(InferenceServerException, match="max_batch_size: expected an integer"):
        client.load_model("simple")
    assert _infer(client, "simple") == "1"


def test_a_load_reads_its_config_off_the_event_loop(
    run_appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config, its version policy and its label files (up to 16 MiB) are read and
    parsed on a worker thread at every load and reload, never on the event loop."""
    modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    srv = run_appliance(tmp_path)
    threads: list[threading.Thread] = []
    real = repository.what_to_load

    def recorded(*args: object) -> object:
        threads.append(threading.current_thread())
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(repository, "what_to_load", recorded)
    client = httpclient.InferenceServerClient(srv.url)
    client.load_model("simple")
    assert threads and srv.thread not in threads, threads
    assert _infer(client, "simple") == "1"
