"""One record per version: a load keeps a version whose config and files did not change,
so a candidate loaded next to the serving version is promoted, not built again.

A kept copy keeps its statistics (a copy built again starts at zero), which is how
these tests tell the two apart through the public API alone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient
import yaml
from http_helpers import post_json
from mosquitto import wait_until

from devtools import modelgen

CONFIG = yaml.safe_load(modelgen.SIMPLE_CONFIG)


def _infer(client: httpclient.InferenceServerClient, version: str = "") -> str:
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(np.ones((1, 16), np.int32))
    result = client.infer("simple", inputs, model_version=version)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2))
    return str(result.get_response()["model_version"])


def _successes(client: httpclient.InferenceServerClient, model: str = "simple") -> dict[str, int]:
    stats = client.get_inference_statistics(model)["model_stats"]
    return {s["version"]: int(s["inference_stats"]["success"]["count"]) for s in stats}


def _load(url: str, model: str, versions: list[int], default: int = 0, **extra: Any) -> int:
    config = {**CONFIG, **extra, "version_policy": {"specific": {"versions": versions}}}
    params: dict[str, Any] = {"config": json.dumps(config)}
    if default:
        params["default_version"] = default
    status, body = post_json(f"{url}/v2/repository/models/{model}/load", {"parameters": params})
    assert status in (200, 400), body
    return status


def _rows(client: httpclient.InferenceServerClient, model: str) -> list[tuple[str, str]]:
    return [
        (r["version"], r["state"])
        for r in client.get_model_repository_index()
        if r["name"] == model and "version" in r
    ]


def test_the_switch_promotes_the_tested_copy(run_appliance, tmp_path: Path) -> None:
    folder = modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub(), yaml.dump(CONFIG))
    srv = run_appliance(tmp_path, model_control_mode="explicit", load_model=["simple"])
    client = httpclient.InferenceServerClient(srv.url)
    url = f"http://{srv.url}"
    assert _infer(client) == "1" and _infer(client) == "1"
    shutil.copytree(folder / "1", folder / "2")

    # the candidate loads beside the serving version, which is kept as it is
    assert _load(url, "simple", [1, 2], default=1) == 200
    assert _successes(client) == {"1": 2, "2": 0}
    assert _infer(client) == "1"  # unversioned traffic stays on the old version
    for _ in range(3):
        assert _infer(client, "2") == "2"  # the self-test, by version

    # the switch builds nothing: the tested copy takes the traffic, the old one drains
    assert _load(url, "simple", [2]) == 200
    assert _infer(client) == "2"
    wait_until(lambda: _rows(client, "simple") == [("2", "READY")])
    assert _successes(client) == {"2": 4}

    # a load that changes nothing keeps the copy too
    assert _load(url, "simple", [2]) == 200
    assert _successes(client) == {"2": 4}


def test_a_changed_file_or_config_builds_a_new_copy(run_appliance, tmp_path: Path) -> None:
    folder = modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub(), yaml.dump(CONFIG))
    srv = run_appliance(tmp_path, model_control_mode="explicit", load_model=["simple"])
    client = httpclient.InferenceServerClient(srv.url)
    url = f"http://{srv.url}"
    _infer(client)
    assert _load(url, "simple", [1]) == 200
    assert _successes(client) == {"1": 1}  # same config, same files: kept

    model = folder / "1" / "model.onnx"
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert _load(url, "simple", [1]) == 200
    assert _successes(client) == {"1": 0}  # the file changed: a new copy

    _infer(client)
    assert _load(url, "simple", [1], dynamic_batching={}) == 200
    assert _successes(client) == {"1": 0}  # the config changed: a new copy
    assert client.get_model_config("simple").get("dynamic_batching") is not None


def test_an_update_builds_one_copy_only(run_appliance, tmp_path: Path, caplog: Any) -> None:
    """Load the candidate beside the serving version, switch, drop: the candidate is
    built once and the serving version never again, so memory holds at most one copy
    more than before the update (each build logs "loaded model")."""
    folder = modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub(), yaml.dump(CONFIG))
    srv = run_appliance(tmp_path, model_control_mode="explicit", load_model=["simple"])
    url = f"http://{srv.url}"
    shutil.copytree(folder / "1", folder / "2")
    caplog.set_level(logging.INFO, logger="appliance.core.loader")
    caplog.clear()
    assert _load(url, "simple", [1, 2], default=1) == 200
    assert _load(url, "simple", [2]) == 200
    builds = [
        r.getMessage().split(":")[0] for r in caplog.records if "loaded model" in r.getMessage()
    ]
    assert builds == ["loaded model 'simple' version 2"]


def test_poll_mode_keeps_the_versions_that_did_not_change(run_appliance, tmp_path: Path) -> None:
    config = {**CONFIG, "version_policy": {"all": {}}}
    folder = modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub(), yaml.dump(config))
    srv = run_appliance(tmp_path, model_control_mode="poll", repository_poll_secs=0.05)
    client = httpclient.InferenceServerClient(srv.url)
    assert _infer(client) == "1"
    staging = folder / ".2.tmp"
    shutil.copytree(folder / "1", staging)
    staging.rename(folder / "2")
    wait_until(lambda: _rows(client, "simple") == [("1", "READY"), ("2", "READY")])
    assert _successes(client) == {"1": 1, "2": 0}
