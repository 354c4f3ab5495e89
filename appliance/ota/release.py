"""What a release must satisfy, checked by the same code everywhere it is checked.

``appliance bundle build``, ``appliance fleet publish`` and the device's verify
step all call these functions, so the fleet tools refuse exactly what a device
would refuse, before anything is published:

- the model's config is read by the server's own reader
  (:func:`appliance.config.reader.parse_config_text`, which also refuses YAML
  nested beyond the recursion limit) and must convert to Triton's protobuf
  ``ModelConfig`` (the form the device writes to disk: integers beyond int64 and
  the like fail here, not on the device);
- the backend is resolved from the config (``backend``, else ``platform``, else
  the model file's suffix) as the server resolves it, and must equal the
  manifest's ``backend`` and the signed target's;
- a model keeps its backend for life. Triton keeps one config per model for all
  its versions, and during an update the version kept for rollback is loaded with
  the candidate's config: a Python config cannot serve an ONNX version. A release
  that changes the backend is refused (``fleet publish`` against the versions
  already published, the device against what it has installed), with the advice to
  publish it under a new model name.
"""

from __future__ import annotations

import json
import os
from typing import Any

from appliance import backends
from appliance.config.model_config import ModelConfig
from appliance.config.reader import parse_config_text
from appliance.config.schema import model_config_pb2
from appliance.config.triton_config import to_triton_json
from appliance.errors import ApplianceError
from appliance.ota import OtaError
from appliance.ota.manifest import Manifest

ENSEMBLE = "ensemble"


def read_config(model: str, config_file: str, data: bytes, where: str) -> ModelConfig:
    """A bundle's config, validated as the server validates a config file."""
    try:
        return parse_config_text(data.decode("utf-8"), config_file, model, where)
    except UnicodeDecodeError as exc:
        raise OtaError(f"{where}: the model config is not UTF-8 text: {exc}") from None
    except ApplianceError as exc:
        raise OtaError(f"the model config is invalid: {exc}") from None


def canonical(config: ModelConfig) -> dict[str, Any]:
    """The config in Triton's JSON form, checked to convert to Triton's protobuf message
    (what the device writes as ``config.pbtxt``)."""
    from google.protobuf import json_format  # first use: start-up time

    doc = to_triton_json(config)
    try:
        json_format.Parse(json.dumps(doc), model_config_pb2().ModelConfig())
    except (json_format.ParseError, ValueError, RecursionError) as exc:
        raise OtaError(f"the model config does not fit Triton's schema: {exc}") from None
    return doc


def backend_of(config: ModelConfig, files: list[str]) -> str:
    """The backend the server would pick for this config and version folder's files."""
    if config.platform == ENSEMBLE:
        return ENSEMBLE
    name = config.backend or backends.PLATFORMS.get(config.platform, "")
    if config.platform and not name:
        raise OtaError(f"the model config names an unsupported platform {config.platform!r}")
    if not name:
        named = config.default_model_filename
        candidates = [named] if named else sorted(files)
        for f in candidates:
            found = backends.BY_SUFFIX.get(os.path.splitext(f)[1])
            if found:
                return found
        raise OtaError(
            f"the model config names no backend and no file has a model suffix "
            f"({', '.join(sorted(backends.BY_SUFFIX))})"
        )
    if name not in backends.BACKENDS:
        raise OtaError(f"the model config names an unknown backend {name!r}")
    return name


def check_backend(model: str, new: str, old: str, where: str) -> None:
    """Refuse a release of ``model`` that would change its backend from ``old``."""
    if old and new != old:
        raise OtaError(
            f"model '{model}' {where} with backend {old}; this release uses {new}. A model "
            f"keeps its backend across versions (one config serves every version): "
            f"publish it under a new model name"
        )


def check_claims(manifest_backend: str, config_backend: str, signed: Any) -> None:
    """The manifest, its config and (on the device) the signed target agree."""
    if manifest_backend != config_backend:
        raise OtaError(
            f"the manifest says backend {manifest_backend!r}, but the config it ships is "
            f"served by {config_backend!r}"
        )
    if signed is not None and signed != manifest_backend:
        raise OtaError(
            f"the signed target says backend {signed!r}, but the bundle's manifest says "
            f"{manifest_backend!r}"
        )


def check_bundle(
    manifest: Manifest, config_data: bytes, signed_backend: str = ""
) -> dict[str, Any]:
    """Everything a bundle's own content must satisfy (its config as the server reads
    it and the backend claims); the config in Triton's JSON form. ``signed_backend``:
    what the signed target claims, on the device ("": not known)."""
    config = read_config(manifest.name, manifest.config_file, config_data, "bundle")
    doc = canonical(config)
    backend = backend_of(config, [f.path for f in manifest.files])
    check_claims(manifest.backend, backend, signed_backend or None)
    return doc
