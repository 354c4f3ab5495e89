"""Triton's own forms of a model config: ``config.pbtxt`` and JSON in, JSON out.

``config.pbtxt`` (protobuf text format) and the JSON a repository load request may
carry as its ``config`` parameter are parsed by protobuf itself into the
``ModelConfig`` message that ``tritonclient`` ships (generated from Triton's
``model_config.proto``), so nothing here is a hand-written parser. The message is
then turned into the plain mapping :func:`appliance.config.model_config.parse_model_config`
validates, exactly as a ``config.yaml`` would be: one validator, one set of error
messages, whichever file a model comes with. :func:`to_triton_json` writes a config
back in Triton's JSON form (the config endpoint), which that schema accepts, and
:func:`dict_to_pbtxt` that form as ``config.pbtxt`` text.

The generated module comes through :mod:`appliance.config.schema`, which
loads it without grpcio (the gRPC endpoint is an extra); protobuf is imported on
first use, so parsing no config costs no start-up time.
"""

from __future__ import annotations

from typing import Any

from appliance import datatypes
from appliance.config.fields import ConfigError
from appliance.config.model_config import InstanceGroup, ModelConfig, TensorConfig
from appliance.config.schema import model_config_pb2
from appliance.config.warmup_config import WarmupInput, WarmupSample


def _as_dict(message: Any) -> dict[str, Any]:
    from google.protobuf import json_format  # first use: start-up time

    # proto field names (max_batch_size, not maxBatchSize): the validator's names.
    # Fields left at their default are absent, so "max_batch_size: 0" reads as
    # unspecified and auto-complete decides, as Triton's does.
    doc: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return doc


def _parse(text: str, source: str, form: str) -> dict[str, Any]:
    """Triton's ModelConfig from protobuf ``text`` or ``json`` form, as a plain dict."""
    from google.protobuf import json_format, text_format  # first use: start-up time

    message = model_config_pb2().ModelConfig()
    try:
        if form == "text":
            text_format.Parse(text, message)
        else:
            json_format.Parse(text, message)
    except (text_format.ParseError, json_format.ParseError) as exc:
        raise ConfigError(source, "", f"not a valid Triton model config: {exc}") from None
    return _as_dict(message)


def pbtxt_to_dict(text: str, source: str) -> dict[str, Any]:
    """Parse ``config.pbtxt`` text; a syntax error or unknown field names the line."""
    return _parse(text, source, "text")


def json_to_dict(text: str, source: str) -> dict[str, Any]:
    """Parse Triton's JSON model config (a load request's ``config`` parameter)."""
    if not text.lstrip().startswith("{"):  # protobuf would read ``[]`` as an empty config
        raise ConfigError(source, "", "not a valid Triton model config: expected a JSON object")
    return _parse(text, source, "json")


def dict_to_pbtxt(doc: dict[str, Any], ignore_unknown: bool = False) -> str:
    """Triton's JSON form of a config as ``config.pbtxt`` text (protobuf's own printer).

    ``ignore_unknown`` drops fields the schema lacks; otherwise they are a ConfigError.
    Needs protobuf and the schema only, never grpcio: the OTA agent and ``appliance
    tune`` write repositories on devices installed without the gRPC endpoint."""
    from google.protobuf import json_format, text_format  # first use: start-up time

    message = model_config_pb2().ModelConfig()
    try:
        json_format.ParseDict(doc, message, ignore_unknown_fields=ignore_unknown)
    except json_format.ParseError as exc:
        raise ConfigError("<config>", "", f"not a valid Triton model config: {exc}") from None
    return str(text_format.MessageToString(message))


def to_triton_json(config: ModelConfig) -> dict[str, Any]:
    """The model config in Triton's JSON form (GET /v2/models/{m}/config)."""

    def tensor(t: TensorConfig) -> dict[str, Any]:
        doc = {
            "name": t.name,
            "data_type": datatypes.to_config_type(t.datatype),
            "format": t.format,
            "dims": list(t.dims),
            "optional": t.optional,
        }
        if t.reshape is not None:
            doc["reshape"] = {"shape": list(t.reshape)}
        return doc

    def output(t: TensorConfig) -> dict[str, Any]:  # ModelOutput has no format or optional
        doc: dict[str, Any] = {
            "name": t.name,
            "data_type": datatypes.to_config_type(t.datatype),
            "dims": list(t.dims),
            "label_filename": t.label_filename,
        }
        if t.reshape is not None:
            doc["reshape"] = {"shape": list(t.reshape)}
        return doc

    policy: dict[str, Any]
    vp = config.version_policy
    if vp.kind == "latest":
        policy = {"latest": {"num_versions": vp.num_versions}}
    elif vp.kind == "specific":
        policy = {"specific": {"versions": list(vp.versions)}}
    else:
        policy = {"all": {}}
    out: dict[str, Any] = {
        "name": config.name,
        "platform": config.platform,
        "backend": config.backend,
        "version_policy": policy,
        "max_batch_size": config.batch_size,
        "input": [tensor(t) for t in config.inputs],
        "output": [output(t) for t in config.outputs],
        "instance_group": [
            _group_json(config.name, i, g) for i, g in enumerate(config.instance_group)
        ],
        "default_model_filename": config.default_model_filename,
        "parameters": {k: {"string_value": v} for k, v in config.parameters.items()},
    }
    if config.decoupled:
        out["model_transaction_policy"] = {"decoupled": True}
    if config.response_cache:
        out["response_cache"] = {"enable": True}
    if config.ensemble_steps:
        out["ensemble_scheduling"] = {
            "step": [
                {
                    "model_name": s.model_name,
                    "model_version": s.model_version,
                    "input_map": dict(s.input_map),
                    "output_map": dict(s.output_map),
                }
                for s in config.ensemble_steps
            ]
        }
    if config.model_warmup:
        out["model_warmup"] = [_warmup_json(w) for w in config.model_warmup]
    if config.sequence_batching is not None:
        out["sequence_batching"] = config.sequence_batching.json()
    if config.dynamic_batching is not None:
        db = config.dynamic_batching
        out["dynamic_batching"] = {
            "preferred_batch_size": list(db.preferred_batch_size),
            "max_queue_delay_microseconds": db.max_queue_delay_us,
            "default_queue_policy": db.default_queue_policy.json(),
        }
        if db.priority_levels:
            out["dynamic_batching"]["priority_levels"] = db.priority_levels
            out["dynamic_batching"]["default_priority_level"] = db.default_priority_level
        if db.priority_queue_policy:
            out["dynamic_batching"]["priority_queue_policy"] = {
                str(level): policy.json() for level, policy in db.priority_queue_policy
            }
    return out


def _group_json(model: str, index: int, group: InstanceGroup) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": f"{model}_{index}", "kind": group.kind, "count": group.count}
    if group.rate_limiter is not None:
        doc["rate_limiter"] = {
            "resources": [
                {"name": r.name, "global": r.is_global, "count": r.count}
                for r in group.rate_limiter.resources
            ],
            "priority": group.rate_limiter.priority,
        }
    return doc


def _warmup_json(w: WarmupSample) -> dict[str, Any]:
    def one(i: WarmupInput) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "data_type": datatypes.to_config_type(i.datatype),
            "dims": list(i.dims),
        }
        if i.data == "file":
            doc["input_data_file"] = i.file
        else:
            doc[f"{i.data}_data"] = True
        return doc

    return {
        "name": w.name,
        "batch_size": w.batch_size,
        "inputs": {i.name: one(i) for i in w.inputs},
        "count": w.count,
    }
