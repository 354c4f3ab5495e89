"""Server configuration (``appliance.yaml``), validated once into a typed object.

Command-line flags override the file; every error names the file and the field,
e.g. ``appliance.yaml: http_port: expected an integer >= 0, got 'eighty'``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from appliance.config import ConfigError, Fields

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_size(value: Any, source: str, key: str) -> int:
    """'64MiB', '1.5GB', 1048576 -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(source, key, f"expected a size such as 64MiB or 1.5GB, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_repository: Path | None = None  # None = the built-in demo models
    host: str = "127.0.0.1"
    http_port: int = 8000  # -1 disables the HTTP endpoint (in-process use)
    grpc_port: int = 8001  # -1 disables the gRPC endpoint
    metrics_port: int = 8002  # -1 disables the metrics endpoint
    max_request_size: int = 64 * 2**20  # HTTP bodies and gRPC messages, each way
    shared_memory: str = "off"  # off | system (Triton's system shared-memory extension)
    drain_timeout_s: float = 30.0
    default_max_batch_size: int = 8
    default_max_queue_size: int = 1024
    log_level: str = "info"
    event_loop: str = "auto"  # auto (uvloop when installed) | asyncio | uvloop


def load_server_config(path: Path | None, overrides: dict[str, Any]) -> ServerConfig:
    """Read appliance.yaml (optional) and apply command-line overrides on top."""
    source = str(path) if path else "<command line>"
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except OSError as exc:
            raise ConfigError(source, "", f"cannot read: {exc.strerror}") from None
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(source, "", f"not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(source, "", f"expected a mapping, got {type(data).__name__}")
    data.update({k: v for k, v in overrides.items() if v is not None})
    f = Fields(source, data)
    f.check_keys(set(ServerConfig.__slots__))
    level = f.text("log_level", "info").lower()
    if level not in ("debug", "info", "warning", "error"):
        raise f.fail("log_level", f"expected debug, info, warning or error, got {level!r}")
    drain = data.get("drain_timeout_s", 30.0)
    if not isinstance(drain, (int, float)) or isinstance(drain, bool) or drain < 0:
        raise f.fail("drain_timeout_s", f"expected a number of seconds >= 0, got {drain!r}")
    repo = data.get("model_repository")
    if repo is not None:
        repo = Path(os.path.expanduser(str(repo)))
        if (
            path is not None
            and not repo.is_absolute()
            and overrides.get("model_repository") is None
        ):
            repo = path.parent / repo  # relative to the config file
        if not repo.is_dir():
            raise f.fail("model_repository", f"expected a directory, {str(repo)!r} is not one")
    return ServerConfig(
        model_repository=repo,
        host=f.text("host", "127.0.0.1"),
        http_port=f.integer("http_port", 8000, minimum=-1),
        metrics_port=f.integer("metrics_port", 8002, minimum=-1),
        grpc_port=f.integer("grpc_port", 8001, minimum=-1),
        shared_memory=_choice(f, "shared_memory", "off", ("off", "system")),
        max_request_size=parse_size(
            data.get("max_request_size", 64 * 2**20), source, "max_request_size"
        ),
        drain_timeout_s=float(drain),
        default_max_batch_size=f.integer("default_max_batch_size", 8, minimum=1),
        default_max_queue_size=f.integer("default_max_queue_size", 1024, minimum=1),
        log_level=level,
        event_loop=_choice(f, "event_loop", "auto", ("auto", "asyncio", "uvloop")),
    )


def _choice(f: Fields, key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = f.text(key, default)
    if value not in allowed:
        raise f.fail(key, f"expected one of {', '.join(allowed)}, got {value!r}")
    return value
