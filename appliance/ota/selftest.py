"""Self-test vectors: a bundle's sample inputs with the outputs they must give.

A vector is ``{"inputs": {NAME: {"datatype", "shape", "data"}}, "outputs": {NAME:
{"datatype", "shape", "data"}}, "tolerance": 1e-5}``; ``data`` is flat, row-major.
Numbers compare within the absolute tolerance, everything else exactly.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from appliance.ota import OtaError
from appliance.ota.server_api import ServerApi
from appliance.ota.state import fsync_dir


def _tensor(name: str, t: Any) -> dict[str, Any]:
    if not isinstance(t, dict) or not isinstance(t.get("datatype"), str):
        raise OtaError(f"self-test tensor {name!r}: expected datatype, shape and data")
    shape, data = t.get("shape"), t.get("data")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise OtaError(f"self-test tensor {name!r}: shape must be a list of sizes")
    if not isinstance(data, list) or len(data) != math.prod(shape):
        raise OtaError(f"self-test tensor {name!r}: data must hold prod(shape) values")
    return {"name": name, "datatype": t["datatype"], "shape": shape, "data": data}


def _close(got: list[Any], want: list[Any], tolerance: float) -> bool:
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        if isinstance(w, (int, float)) and not isinstance(w, bool):
            if not isinstance(g, (int, float)) or abs(g - w) > tolerance:
                return False
        elif g != w:
            return False
    return True


def run(api: ServerApi, model: str, version: int, vectors: tuple[dict[str, Any], ...]) -> int:
    """Run every vector against ``model`` version ``version``; returns how many ran.
    OtaError naming the first vector and output that differs."""
    for i, vector in enumerate(vectors):
        check(api, model, version, i, vector)
    return len(vectors)


def check(
    api: ServerApi, model: str, version: int, i: int, vector: Any, timeout_s: float = 0.0
) -> None:
    """Vector ``i`` against the version (its answer within ``timeout_s``, 0: the
    server API's own timeout); OtaError when the outputs differ."""
    if not isinstance(vector, dict):
        raise OtaError(f"self-test vector {i}: expected an object")
    inputs = vector.get("inputs")
    outputs = vector.get("outputs")
    tolerance = vector.get("tolerance", 1e-5)
    if not isinstance(inputs, dict) or not isinstance(outputs, dict) or not outputs:
        raise OtaError(f"self-test vector {i}: expected 'inputs' and 'outputs' objects")
    if not isinstance(tolerance, (int, float)):
        raise OtaError(f"self-test vector {i}: tolerance must be a number")
    body = {
        "inputs": [_tensor(n, t) for n, t in inputs.items()],
        "outputs": [{"name": n} for n in outputs],
    }
    result = api.infer(model, version, body, timeout_s)
    got = {o["name"]: o for o in result.get("outputs", []) if isinstance(o, dict)}
    for name, expected in outputs.items():
        want = _tensor(name, expected)
        out = got.get(name)
        if out is None:
            raise OtaError(f"self-test vector {i}: the model gave no output {name!r}")
        if list(out.get("shape", [])) != want["shape"] or not _close(
            list(out.get("data", [])), want["data"], float(tolerance)
        ):
            raise OtaError(
                f"self-test vector {i}: output {name!r} differs from the expected "
                f"values (tolerance {tolerance})"
            )


# A committed model version's vectors, kept after its bundle is gone: a software
# update runs them against the new server (abinstall's watch). One file per model,
# replaced atomically at each commit: ``<state_dir>/vectors/<model>.json``.
KEPT = "vectors"


def keep(state_dir: Path, model: str, version: int, vectors: tuple[dict[str, Any], ...]) -> None:
    """Keep ``vectors`` as those of ``model`` version ``version`` (none: forget the
    model's, so an older version's are never run against a newer one)."""
    folder = state_dir / KEPT
    path = folder / f"{model}.json"
    if not vectors:
        path.unlink(missing_ok=True)
        return
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"model": model, "version": version, "vectors": list(vectors)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(folder)


def kept(state_dir: Path, model: str, version: int) -> tuple[dict[str, Any], ...]:
    """The vectors kept for ``model`` version ``version`` (none when that version's
    were not kept, or the file is unreadable: a probe generated from the config is
    then what the caller has)."""
    try:
        doc = json.loads((state_dir / KEPT / f"{model}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    if not isinstance(doc, dict) or doc.get("model") != model or doc.get("version") != version:
        return ()
    vectors = doc.get("vectors")
    if not isinstance(vectors, list) or not all(isinstance(v, dict) for v in vectors):
        return ()
    return tuple(vectors)
