"""Probes made from a model's config, for a bundle that has no self-test vectors.

An update that lands in a night-time maintenance window sees no traffic, and a
bundle without vectors gave probation nothing to count. So the agent probes with
inputs generated from the candidate's config, as Triton's ``model_warmup`` does:
each declared input at its declared shape (a variable dimension as 1, a batch of
1 when the model batches) filled with zeros (even probes) or random values of
its type (odd probes: floats in [0, 1), integers and booleans 0 or 1, strings
empty). A probe passes when the model answers every declared output within the
timeout: it proves the model answers, not that it answers right, and the job's
report says which kind of probe was used (``vectors``, ``generated``, or
``none: <why>``).

A model whose inputs cannot be generated (a sequence model needs correlation ids,
an input of a type or shape the config does not fix) gets no generated probe.
"""

from __future__ import annotations

import math
import random
from typing import Any

from appliance.ota import OtaError
from appliance.ota.server_api import ServerApi

_FLOATS = ("FP16", "FP32", "FP64", "BF16")
_INTS = ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")
MAX_ELEMENTS = 1 << 20  # a generated probe stays small (a model declaring more gets none)


def _dims(raw: Any) -> list[int]:
    if not isinstance(raw, list):
        raise ValueError("no dims")
    return [max(int(d), 1) if int(d) != -1 else 1 for d in raw]  # (proto JSON: strings)


def inputs_of(config: dict[str, Any]) -> tuple[list[tuple[str, str, list[int]]], str]:
    """The (name, datatype, shape) of each input to generate, or ([], why not)."""
    if "sequence_batching" in config:
        return [], "a sequence model needs correlation ids"
    batch = [1] if int(config.get("max_batch_size", 0) or 0) > 0 else []
    out = []
    for spec in config.get("input", []):
        if not isinstance(spec, dict) or spec.get("optional"):
            continue
        name, kind = str(spec.get("name", "")), str(spec.get("data_type", ""))
        datatype = kind.removeprefix("TYPE_")
        if datatype == "STRING":
            datatype = "BYTES"
        if not name or datatype not in (*_FLOATS, *_INTS, "BOOL", "BYTES"):
            return [], f"input {name!r} has a type a probe cannot fill ({kind or 'none'})"
        try:
            shape = batch + _dims(spec.get("dims"))
        except (TypeError, ValueError):
            return [], f"input {name!r} has no fixed shape"
        if math.prod(shape) > MAX_ELEMENTS:
            return [], f"input {name!r} is too large for a probe"
        out.append((name, datatype, shape))
    if not out:
        return [], "the config declares no inputs"
    return out, ""


def _data(datatype: str, count: int, rng: random.Random | None) -> list[Any]:
    if datatype == "BYTES":
        return [""] * count
    if datatype == "BOOL":
        return [bool(rng.getrandbits(1)) if rng else False for _ in range(count)]
    if rng is None:
        return [0] * count
    if datatype in _FLOATS:
        return [rng.random() for _ in range(count)]
    return [rng.getrandbits(1) for _ in range(count)]


def body(config: dict[str, Any], n: int) -> dict[str, Any]:
    """Probe ``n``'s request (zeros when ``n`` is even, random values when odd);
    OtaError when the config allows none."""
    specs, why = inputs_of(config)
    if not specs:
        raise OtaError(why)
    rng = random.Random(n) if n % 2 else None
    inputs = [
        {"name": name, "datatype": dt, "shape": shape, "data": _data(dt, math.prod(shape), rng)}
        for name, dt, shape in specs
    ]
    outputs = [{"name": str(o["name"])} for o in config.get("output", []) if isinstance(o, dict)]
    return {"inputs": inputs, "outputs": outputs} if outputs else {"inputs": inputs}


def check(
    api: ServerApi, model: str, version: int, config: dict[str, Any], n: int, timeout_s: float
) -> None:
    """Send probe ``n``; OtaError unless every declared output came back."""
    request = body(config, n)
    result = api.infer(model, version, request, timeout_s)
    got = {o.get("name") for o in result.get("outputs", []) if isinstance(o, dict)}
    missing = [o["name"] for o in request.get("outputs", []) if o["name"] not in got]
    if missing or not got:
        raise OtaError(f"generated probe {n}: the model gave no output {missing or ''}")
