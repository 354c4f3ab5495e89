"""Model warm-up (Triton's ``model_warmup``): samples run on every instance before READY.

Warm-up makes the first real request as fast as the rest (engines allocate and
tune on their first run) and lets the memory measurement see an instance's
working memory, not only its weights. Samples are built once per model copy from
the completed config; each instance runs them on its own worker thread.

A model without ``model_warmup`` gets one implicit sample, the *memory probe*:
zeros at batch size 1, at the dims the completed config states (a config may fix
dims the graph leaves dynamic), the dims still dynamic as 1. Its failure is not the
model's: the load goes on, measured without working memory. Either way the figure
can fall far short of what a real input needs (a text detector with dims
``[3, -1, -1]``: a few MiB at 1x1 against hundreds at a camera frame), so
:func:`lower_bound` says when the measured memory is a lower bound, and the loader
warns naming the model and tells how to measure it right (a ``model_warmup`` at the
largest input).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from appliance import datatypes, names
from appliance.backends.base import Backend
from appliance.config.fields import ConfigError
from appliance.config.model_config import ModelConfig
from appliance.config.warmup_config import WarmupInput
from appliance.errors import ApplianceError, invalid

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sample:
    """A ready-to-run warm-up request. ``required``: a failure fails the load."""

    name: str
    inputs: dict[str, np.ndarray]
    count: int
    required: bool


def _one_row(
    spec: WarmupInput, model_dir: Path, where: str, source: str, allow_links: bool
) -> np.ndarray:
    """One batch row of a declared warm-up input."""
    shape = spec.dims
    if spec.datatype == "BYTES":
        if spec.data == "file":
            raw = _read(model_dir, spec.file, where, source, allow_links)
            return datatypes.deserialize_bytes(raw, shape, spec.name)
        # zero and random data of a string tensor: empty strings, as for zero_data
        return np.full(shape, b"", dtype=object)
    dtype = datatypes.to_numpy_dtype(spec.datatype)
    if spec.data == "zero":
        return np.zeros(shape, dtype)
    if spec.data == "random":
        rng = np.random.default_rng(0)
        if dtype.kind == "b":
            return rng.integers(0, 2, shape).astype(dtype)
        if dtype.kind in "iu":
            return rng.integers(0, 100, shape).astype(dtype)
        return rng.random(shape).astype(dtype)
    raw = _read(model_dir, spec.file, where, source, allow_links)
    expected = datatypes.byte_size(spec.datatype, shape)
    if len(raw) != expected:
        raise ConfigError(
            source,
            where,
            f"input_data_file {spec.file!r} has {len(raw)} bytes, "
            f"dims {list(shape)} of {spec.datatype} need {expected}",
        )
    return np.frombuffer(raw, dtype).reshape(shape)


def _read(model_dir: Path, name: str, where: str, source: str, allow_links: bool) -> bytes:
    """The bytes of ``warmup/<name>``: one file name (checked when the config was
    parsed) whose file, links followed, lies inside the repository."""
    path = model_dir / "warmup" / name
    try:
        names.confine(model_dir.parent, path, allow_links, f"input_data_file {name!r}")
    except ApplianceError as exc:
        raise ConfigError(source, where, exc.message) from None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(source, where, f"cannot read {path}: {exc.strerror}") from None


def samples(config: ModelConfig, model_dir: Path, allow_links: bool = False) -> list[Sample]:
    """The warm-up samples of a completed config, checked against its inputs; data
    files are read from ``model_dir/warmup`` (see :func:`_read`)."""
    if not config.model_warmup:
        # a decoupled model answers into a stream only a request has: not probed (an
        # engine of that kind warms itself up and reports its memory)
        return [] if config.decoupled else [probe(config)]
    out = []
    batched = config.batch_size > 0
    by_name = {t.name: t for t in config.inputs}
    for i, w in enumerate(config.model_warmup):
        at = f"model_warmup[{i}]"
        if w.batch_size > max(1, config.batch_size):
            raise ConfigError(
                config.source,
                f"{at}.batch_size",
                f"{w.batch_size} exceeds max_batch_size {config.batch_size}",
            )
        given = {x.name for x in w.inputs}
        missing = [t.name for t in config.inputs if not t.optional and t.name not in given]
        if missing:
            raise ConfigError(config.source, f"{at}.inputs", f"lacks the model's inputs {missing}")
        inputs = {}
        for spec in w.inputs:
            where = f"{at}.inputs.{spec.name}"
            tensor = by_name.get(spec.name)
            if tensor is None:
                raise ConfigError(
                    config.source, where, f"the model has no such input; it has {sorted(by_name)}"
                )
            if spec.datatype != tensor.datatype:
                raise ConfigError(
                    config.source,
                    where,
                    f"data_type {spec.datatype} but the input is {tensor.datatype}",
                )
            if len(spec.dims) != len(tensor.dims) or any(
                c not in (-1, d) for c, d in zip(tensor.dims, spec.dims, strict=True)
            ):
                raise ConfigError(
                    config.source,
                    where,
                    f"dims {list(spec.dims)} do not fit the input's dims {list(tensor.dims)}",
                )
            row = _one_row(spec, model_dir, where, config.source, allow_links)
            if tensor.reshape is not None:  # the engine sees the reshaped tensor
                row = row.reshape(tensor.reshape)
            inputs[spec.name] = np.stack([row] * w.batch_size) if batched else row
        out.append(Sample(w.name, inputs, w.count, required=True))
    return out


def probe(config: ModelConfig) -> Sample:
    """The implicit sample: zeros, batch size 1, every dynamic dim 1."""
    lead = [1] if config.batch_size > 0 else []
    inputs = {}
    for t in config.inputs:
        if t.optional:
            continue
        shape = lead + [1 if d < 0 else d for d in t.model_dims]
        if t.datatype == "BYTES":
            inputs[t.name] = np.full(shape, b"", dtype=object)
        else:
            inputs[t.name] = np.zeros(shape, datatypes.to_numpy_dtype(t.datatype))
    return Sample("memory probe", inputs, 1, required=False)


def lower_bound(config: ModelConfig, probe_failure: str = "") -> str:
    """Why the memory measured for ``config`` (completed) is a lower bound, or "" when
    it is not: the implicit probe failed (``probe_failure``: only the weights were
    measured), or it ran inputs whose dims are dynamic at 1."""
    if config.model_warmup:
        return ""
    if probe_failure:
        return f"the implicit warm-up run failed ({probe_failure}), only the load was measured"
    if config.decoupled:
        return "a decoupled model is not probed without a model_warmup, only the load was measured"
    dynamic = [
        f"'{t.name}' {list(t.model_dims)}"
        for t in config.inputs
        if not t.optional and any(d < 0 for d in t.model_dims)
    ]
    if not dynamic:
        return ""
    return f"input {', '.join(dynamic)} is measured with each dynamic dim at 1"


def run(backend: Backend, model: str, outputs: list[str], todo: list[Sample]) -> str:
    """Run every sample on ``backend`` (blocking: the instance's own thread); return
    why an optional sample (the memory probe) failed, "" when none did.

    Raises INVALID_ARG naming the sample when a required one fails.
    """
    failure = ""
    for sample in todo:
        for _ in range(sample.count):
            try:
                backend.infer(dict(sample.inputs), outputs)
            except Exception as exc:
                if sample.required:
                    raise invalid(
                        f"model '{model}': warm-up sample '{sample.name}' failed: {exc}"
                    ) from None
                failure = f"{sample.name}: {exc}"
                log.info("model '%s': %s skipped (%s)", model, sample.name, exc)
                break
    return failure
