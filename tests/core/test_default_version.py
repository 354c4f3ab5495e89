"""The repository load parameter ``default_version``: a loaded version that is not the
newest keeps the unversioned traffic; the others answer by explicit version."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import urllib3

from devtools import modelgen

BODY = {
    "inputs": [
        {"name": n, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
        for n in ("INPUT0", "INPUT1")
    ]
}


def _load(url: str, params: dict[str, Any]) -> urllib3.BaseHTTPResponse:
    return urllib3.request(
        "POST", f"{url}/v2/repository/models/simple/load", json={"parameters": params}
    )


def _version(url: str, path: str = "") -> str:
    r = urllib3.request("POST", f"{url}/v2/models/simple{path}/infer", json=BODY)
    assert r.status == 200, r.data
    return str(json.loads(r.data)["model_version"])


def test_default_version_pins_unversioned_traffic(tmp_path: Path, run_appliance: Any) -> None:
    for v in (1, 2):
        modelgen.write_model(
            tmp_path, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG, v
        )
    url = f"http://{run_appliance(tmp_path, model_control_mode='explicit').url}"
    assert _version(url) == "2"  # latest 1 by default
    config = {
        "backend": "onnxruntime",
        "max_batch_size": 8,
        "version_policy": {"specific": {"versions": [1, 2]}},
    }
    assert _load(url, {"config": json.dumps(config), "default_version": 1}).status == 200
    assert _version(url) == "1"
    assert _version(url, "/versions/2") == "2"
    meta = json.loads(urllib3.request("GET", f"{url}/v2/models/simple").data)
    assert meta["versions"] == ["1", "2"]
    # a plain load goes back to the newest
    assert _load(url, {"config": json.dumps(config)}).status == 200
    assert _version(url) == "2"
    bad = _load(url, {"default_version": "one"})
    assert bad.status == 400 and b"default_version" in bad.data
