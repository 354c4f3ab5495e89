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

from appliance.config.fields import (
    ConfigError,
    Fields,
    existing_path,
    parse_limit,
    parse_size,
    seconds,
)
from appliance.config.mqtt_config import MqttConfig, parse_mqtt
from appliance.config.scheduling_config import ResourceTotal, parse_rate_limit
from appliance.config.streams_config import StreamConfig, parse_streams
from appliance.config.vision_config import VisionConfig, parse_vision
from appliance.datatypes import DEFAULT_MAX_REQUEST_ELEMENTS


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_repository: Path | None = None  # None = the built-in demo models
    host: str = "127.0.0.1"
    http_port: int = 8000  # -1 disables the HTTP endpoint (in-process use)
    grpc_port: int = 8001  # -1 disables the gRPC endpoint
    # the port was asked for (flag or file): without the gRPC libraries the start fails
    # rather than going on without the endpoint (not a config field: see _DERIVED)
    grpc_port_given: bool = False
    metrics_port: int = 8002  # -1 disables the metrics endpoint
    # Triton's latency summaries (nv_inference_*_summary_us, quantiles over the last
    # requests), as `--metrics-config summary_latencies=true` turns them on there
    metrics_summary_latencies: bool = False
    max_request_size: int = 64 * 2**20  # HTTP bodies and gRPC messages, each way
    shared_memory: str = "off"  # off | system (Triton's system shared-memory extension)
    drain_timeout_s: float = 30.0
    default_max_batch_size: int = 8
    default_max_queue_size: int = 1024
    # input bytes queued requests may hold: whole server (None: derived from the memory
    # budget, see queue_bytes.default_limit) and each model (None: the server's)
    max_queued_bytes: int | None = None
    max_queued_bytes_per_model: int | None = None
    log_level: str = "info"
    event_loop: str = "auto"  # auto (uvloop when installed) | asyncio | uvloop
    mqtt: MqttConfig | None = None  # None: no MQTT bridge
    vision: VisionConfig | None = None  # None: no DeepStack detection API (docs/vision.md)
    streams: tuple[StreamConfig, ...] = ()  # cameras the server reads (docs/vision.md)
    # model control, memory and access: see _control() at the end of this module
    model_control_mode: str = "explicit"  # none | explicit | poll
    load_model: tuple[str, ...] = ("*",)  # explicit: models loaded at start ("*": all)
    repository_poll_secs: float = 15.0  # poll: seconds between looks at the repository
    memory_limit: int | None = None  # bytes all loaded models may use; None: unlimited
    admin_token: str = ""  # bearer token for load/unload/shared-memory registration
    inference_token: str = ""  # bearer token for inference and metadata; "": open
    require_admin_token: bool = False  # admin needs the token on loopback too
    tls_cert: Path | None = None  # TLS on the HTTP and gRPC endpoints: certificate and key
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # mutual TLS: clients need a certificate this CA signed
    # the private key that opens sealed (encrypted at rest) model files
    # (appliance/backends/sealed.py)
    model_key_file: Path | None = None
    # what one request may hold and how long a peer may take: see _limits() below
    allow_symlinked_models: bool = False  # model folders/files may link outside the repo
    max_request_elements: int = DEFAULT_MAX_REQUEST_ELEMENTS  # elements one request declares
    http_header_timeout_s: float = 30.0  # a complete request header, or idle keep-alive
    http_body_timeout_s: float = 60.0  # a complete request body
    # the gRPC endpoint's HTTP/2 limits (adapters/grpc/h2/limits.py, docs/security.md)
    grpc_max_connections: int = 256  # open connections; more are turned away (GOAWAY)
    grpc_max_concurrent_streams: int = 100  # calls at once on one connection
    grpc_max_header_list_size: int = 16 * 1024  # request headers, as HTTP/2 counts them
    grpc_idle_timeout_s: float = 300.0  # a connection without calls is closed after this
    grpc_read_timeout_s: float = 30.0  # the preface, a begun frame, a stalled write
    # the name server metadata reports (Triton reports "triton"; a client that checks
    # the name can be served by setting it)
    server_name: str = "appliance"
    # Triton's trace extension: where traces go (the folder must exist); None: no tracing
    trace_file: Path | None = None
    # the trace settings in force at start (Triton's --trace-config): setting -> value,
    # as the trace API takes them (checked by appliance/core/trace.py when the server starts)
    trace_settings: tuple[tuple[str, Any], ...] = ()
    # Triton's response cache (--cache-config local,size=N): bytes of answers kept for
    # models whose config enables it, charged to the memory budget; 0: no cache
    response_cache_size: int = 0
    # Triton's rate limiter (--rate-limit, --rate-limit-resource): off, or execution_count
    # (an instance runs only holding its group's rate_limiter resources, of these totals;
    # none given: the most any loaded instance needs)
    rate_limit: str = "off"
    rate_limit_resources: tuple[ResourceTotal, ...] = ()
    # Triton's --http-header-forward-pattern / --grpc-header-forward-pattern: the request
    # headers whose names this regular expression finds (case-insensitively unless it
    # starts with "(?-i)") become request parameters (strings); "": none
    http_header_forward_pattern: str = ""
    grpc_header_forward_pattern: str = ""


# fields of ServerConfig that are derived, never read from a file
_DERIVED = {"grpc_port_given"}
# fields only a model config has: a server config with these was passed by mistake
_MODEL_FIELDS = {"max_batch_size", "input", "output", "backend", "platform", "instance_group"}


def load_server_config(path: Path | None, overrides: dict[str, Any]) -> ServerConfig:
    """Read appliance.yaml (optional) and apply command-line overrides on top."""
    source = str(path) if path else "<command line>"
    data: dict[str, Any] = {}
    if path is not None:
        import yaml  # loaded only when there is a config file

        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except OSError as exc:
            raise ConfigError(source, "", f"cannot read: {exc.strerror}") from None
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(source, "", f"not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(source, "", f"expected a mapping, got {type(data).__name__}")
    in_file = set(data)  # what the file says, before any flag: the model-config hint's
    overrides = dict(overrides)
    broker = overrides.pop("mqtt_broker", None)  # --mqtt-broker HOST:PORT
    data.update({k: v for k, v in overrides.items() if v is not None})
    if data.get("shared_memory") is False:  # YAML 1.1 reads a bare `off` as false
        data["shared_memory"] = "off"
    f = Fields(source, data)
    if _MODEL_FIELDS & in_file and not set(ServerConfig.__slots__) & in_file:
        raise ConfigError(
            source,
            "",
            "this is a model config (it belongs in a model folder, as "
            "<repository>/<model>/config.yaml), not a server config: pass the repository "
            "with --model-repository",
        )
    # ``ota:`` belongs to the update agent (appliance/ota/config.py), which reads this same file
    f.check_keys(set(ServerConfig.__slots__) - _DERIVED | {"ota"})
    level = f.text("log_level", "info").lower()
    if level not in ("debug", "info", "warning", "error"):
        raise f.fail("log_level", f"expected debug, info, warning or error, got {level!r}")
    drain = seconds(f, "drain_timeout_s", 30.0, 0.0)
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
    mqtt, vision = parse_mqtt(f, path, broker), parse_vision(f, path)
    rate_limit, rate_limit_resources = parse_rate_limit(f)
    return ServerConfig(
        model_repository=repo,
        host=f.text("host", "127.0.0.1"),
        http_port=_port(f, "http_port", 8000),
        metrics_port=_port(f, "metrics_port", 8002),
        grpc_port=_port(f, "grpc_port", 8001),
        grpc_port_given="grpc_port" in data,
        metrics_summary_latencies=f.flag("metrics_summary_latencies", False),
        shared_memory=_choice(f, "shared_memory", "off", ("off", "system")),
        max_request_size=parse_size(data["max_request_size"], source, "max_request_size")
        if "max_request_size" in data
        else 64 * 2**20,
        drain_timeout_s=drain,
        default_max_batch_size=f.integer("default_max_batch_size", 8, minimum=1),
        default_max_queue_size=f.integer("default_max_queue_size", 1024, minimum=1),
        max_queued_bytes=_optional_size(data, source, "max_queued_bytes"),
        max_queued_bytes_per_model=_optional_size(data, source, "max_queued_bytes_per_model"),
        log_level=level,
        event_loop=_choice(f, "event_loop", "auto", ("auto", "asyncio", "uvloop")),
        mqtt=mqtt,
        vision=vision,
        streams=parse_streams(f, path, vision, mqtt),
        server_name=_server_name(f),
        trace_file=_trace_file(f, path),
        trace_settings=_trace_settings(f),
        response_cache_size=_optional_size(data, source, "response_cache_size") or 0,
        rate_limit=rate_limit,
        rate_limit_resources=rate_limit_resources,
        http_header_forward_pattern=_forward_pattern(f, "http_header_forward_pattern"),
        grpc_header_forward_pattern=_forward_pattern(f, "grpc_header_forward_pattern"),
        **_control(f, path),
        **_limits(f),
    )


def _trace_file(f: Fields, base: Path | None) -> Path | None:
    value = f.data.get("trace_file")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise f.fail("trace_file", f"expected a path, got {value!r}")
    path = Path(os.path.expanduser(value))
    if base is not None and not path.is_absolute():
        path = base.parent / path  # relative to the config file
    if not path.parent.is_dir() or path.is_dir():
        raise f.fail("trace_file", f"expected a file in an existing folder, got {str(path)!r}")
    return path


_TRACE_SETTINGS = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_mode")


def _trace_settings(f: Fields) -> tuple[tuple[str, Any], ...]:
    value = f.data.get("trace_settings")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise f.fail("trace_settings", f"expected a mapping of trace settings, got {value!r}")
    for key, item in value.items():
        if key not in _TRACE_SETTINGS:
            raise f.fail(
                "trace_settings",
                f"unknown setting {key!r}; expected one of {list(_TRACE_SETTINGS)}",
            )
        scalar = (str, int)
        if isinstance(item, bool) or not (
            isinstance(item, scalar)
            or (isinstance(item, list) and all(isinstance(x, scalar) for x in item))
        ):
            raise f.fail(f"trace_settings.{key}", f"expected a string or a list, got {item!r}")
    return tuple((str(k), v) for k, v in value.items())


def header_pattern(text: str) -> re.Pattern[str] | None:
    """A header forward pattern compiled as Triton reads it: found anywhere in a
    header's name, case-insensitively unless it starts with ``(?-i)``; None for ""."""
    if not text:
        return None
    if text.startswith("(?-i)"):
        return re.compile(text[len("(?-i)") :])
    return re.compile(text, re.IGNORECASE)


def _forward_pattern(f: Fields, key: str) -> str:
    text = f.text(key, "")
    try:
        header_pattern(text)
    except re.error as exc:
        raise f.fail(key, f"expected a regular expression, got {text!r} ({exc})") from None
    return text


def _server_name(f: Fields) -> str:
    name = f.text("server_name", "appliance")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
        raise f.fail("server_name", f"expected 1-64 letters, digits, '.', '_' or '-', got {name!r}")
    return name


def _optional_size(data: dict[str, Any], source: str, key: str) -> int | None:
    """A size, or None when absent or 'auto' (a default decided elsewhere)."""
    value = data.get(key)
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return parse_size(value, source, key)


def _port(f: Fields, key: str, default: int) -> int:
    value = f.integer(key, default, minimum=-1)
    if value > 65535:
        raise f.fail(key, f"expected a port 0..65535 (or -1: off), got {value}")
    return value


def _choice(f: Fields, key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = f.text(key, default)
    if value not in allowed:
        raise f.fail(key, f"expected one of {', '.join(allowed)}, got {value!r}")
    return value


# ---- model control, memory budget, access (lifecycle.py, memory.py, access.py) --------


def _control(f: Fields, path: Path | None) -> dict[str, Any]:
    mode = _choice(f, "model_control_mode", "explicit", ("none", "explicit", "poll"))
    names = f.data.get("load_model", ["*"])
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
        raise f.fail("load_model", f"expected a list of model names (or '*'), got {names!r}")
    if "load_model" in f.data and mode != "explicit":
        raise f.fail("load_model", f"only applies to model_control_mode explicit, not {mode!r}")
    poll = f.data.get("repository_poll_secs", 15.0)
    if not isinstance(poll, (int, float)) or isinstance(poll, bool) or poll <= 0:
        raise f.fail("repository_poll_secs", f"expected a number of seconds > 0, got {poll!r}")
    require = f.flag("require_admin_token", False)
    cert, key = existing_path(f, "tls_cert", path), existing_path(f, "tls_key", path)
    if (cert is None) != (key is None):
        missing = "tls_cert" if cert is None else "tls_key"
        raise f.fail(missing, "HTTPS needs both tls_cert and tls_key")
    client_ca = existing_path(f, "tls_client_ca", path)
    if client_ca is not None and cert is None:
        raise f.fail("tls_client_ca", "mutual TLS needs tls_cert and tls_key too")
    key_file = _key_file(f, path)
    return {
        "model_key_file": key_file,
        "model_control_mode": mode,
        "load_model": tuple(names),
        "repository_poll_secs": float(poll),
        "memory_limit": parse_limit(f.data.get("memory_limit"), f.source, "memory_limit"),
        "admin_token": f.text("admin_token"),
        "inference_token": f.text("inference_token"),
        "require_admin_token": require,
        "tls_cert": cert,
        "tls_key": key,
        "tls_client_ca": client_ca,
    }


def _key_file(f: Fields, path: Path | None) -> Path | None:
    """``model_key_file``: environment variables expanded (a systemd credential lives
    in ``$CREDENTIALS_DIRECTORY``), readable by this user alone."""
    value = f.data.get("model_key_file")
    if isinstance(value, str):
        f = Fields(f.source, {**f.data, "model_key_file": os.path.expandvars(value)}, f.path)
    key = existing_path(f, "model_key_file", path)
    if key is not None and key.stat().st_mode & 0o077:
        raise f.fail(
            "model_key_file",
            f"{key} is readable by other users; chmod 600 it (the service user alone may read it)",
        )
    return key


# ---- request limits and trust in the repository (limits.py, names.py, http_api.py) ----


def _limits(f: Fields) -> dict[str, Any]:
    return {
        "allow_symlinked_models": f.flag("allow_symlinked_models", False),
        "max_request_elements": f.integer(
            "max_request_elements", DEFAULT_MAX_REQUEST_ELEMENTS, minimum=1
        ),
        "http_header_timeout_s": seconds(f, "http_header_timeout_s", 30.0, 0.01),
        "http_body_timeout_s": seconds(f, "http_body_timeout_s", 60.0, 0.01),
        "grpc_max_connections": f.integer("grpc_max_connections", 256, minimum=1),
        "grpc_max_concurrent_streams": _bounded(f, "grpc_max_concurrent_streams", 100, 2**31 - 1),
        "grpc_max_header_list_size": _header_list(f),
        "grpc_idle_timeout_s": seconds(f, "grpc_idle_timeout_s", 300.0, 0.01),
        "grpc_read_timeout_s": seconds(f, "grpc_read_timeout_s", 30.0, 0.01),
    }


def _bounded(f: Fields, key: str, default: int, most: int) -> int:
    value = f.integer(key, default, minimum=1)
    if value > most:
        raise f.fail(key, f"expected an integer from 1 to {most}, got {value}")
    return value


def _header_list(f: Fields) -> int:
    key = "grpc_max_header_list_size"
    if key not in f.data:
        return 16 * 1024
    value = parse_size(f.data[key], f.source, f.at(key))
    if not 1024 <= value <= 2**20:
        raise f.fail(key, f"expected a size from 1KiB to 1MiB, got {value} bytes")
    return value
