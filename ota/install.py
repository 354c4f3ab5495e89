"""The model repository on disk, as the agent changes it.

What is on disk is what is committed: each model the agent manages gets a
``config.pbtxt`` whose ``version_policy`` names exactly the committed version, so
a server that (re)starts at any moment loads the committed version and never a
candidate under test (boot-loop protection). Candidates are loaded by the agent
with a config override naming both versions; see :mod:`ota.agent`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from appliance.config.model_config import parse_model_config
from appliance.config.reader import CONFIG_FILES, load_model_config
from appliance.config.triton_config import pbtxt_to_dict, to_triton_json
from appliance.core.repository import version_dirs
from appliance.errors import ApplianceError
from ota import OtaError


def canonical(model: str, config_file: str, data: bytes) -> dict[str, Any]:
    """A bundle's config in Triton's JSON form, validated as the server would."""
    try:
        text = data.decode("utf-8")
        raw = (
            pbtxt_to_dict(text, config_file)
            if config_file.endswith(".pbtxt")
            else yaml.safe_load(text)
        )
        return to_triton_json(parse_model_config(raw, model, f"bundle {config_file}"))
    except (ApplianceError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise OtaError(f"the bundle's model config is invalid: {exc}") from None


def with_versions(config: dict[str, Any], versions: list[int]) -> dict[str, Any]:
    return {**config, "version_policy": {"specific": {"versions": sorted(set(versions))}}}


def on_disk(repository: Path, model: str) -> dict[str, Any] | None:
    """The model's current config in Triton JSON form, or None if the model is absent."""
    folder = repository / model
    if not folder.is_dir():
        return None
    try:
        return to_triton_json(load_model_config(folder))
    except ApplianceError as exc:
        raise OtaError(f"model '{model}': its config on disk is invalid: {exc}") from None


def disk_versions(repository: Path, model: str) -> list[int]:
    folder = repository / model
    try:
        return version_dirs(folder) if folder.is_dir() else []
    except ApplianceError:
        return []


def write_config(repository: Path, model: str, config: dict[str, Any]) -> None:
    """Replace the model's config file (atomically) with ``config`` as config.pbtxt."""
    folder = repository / model
    folder.mkdir(parents=True, exist_ok=True)
    message = json_format.Parse(json.dumps(config), model_config_pb2.ModelConfig())
    text = text_format.MessageToString(message)
    tmp = folder / ".config.pbtxt.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    for name in CONFIG_FILES:
        if name != "config.pbtxt":
            (folder / name).unlink(missing_ok=True)
    os.replace(tmp, folder / "config.pbtxt")


def place(staging: Path, repository: Path, model: str, version: int) -> None:
    """Rename the staged files into ``<repository>/<model>/<version>`` (one rename)."""
    dest = repository / model / str(version)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(staging, dest)


def remove_version(repository: Path, model: str, version: int) -> None:
    shutil.rmtree(repository / model / str(version), ignore_errors=True)


def remove_model(repository: Path, model: str) -> None:
    shutil.rmtree(repository / model, ignore_errors=True)


def staging_dir(repository: Path, model: str, version: int) -> Path:
    """Under a hidden (dot) folder of the repository, on the same file system as the
    destination (so placing it is one rename); the server never sees it."""
    return repository / ".ota-staging" / f"{model}-{version}"


def write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any]:
    try:
        doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OtaError(f"cannot read the staged config {path}: {exc}") from None
    return doc
