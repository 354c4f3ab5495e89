"""``appliance doctor``'s checks of ports and the network: the server's ports (and
whether the gRPC endpoint's libraries load), the update agent's config, and whether the
MQTT broker and the OTA source answer, by TCP with a short timeout: doctor contacts
only the addresses the config or the command line names."""

from __future__ import annotations

import socket
import urllib.parse
from pathlib import Path

from appliance.config.server_config import ServerConfig
from appliance.doctor_check import FAIL, OK, WARN, Check
from appliance.errors import ApplianceError


def check_ports(config: ServerConfig) -> Check:
    """Free, or in use (by a running appliance when it answers /v2/health/live); the
    gRPC port is off when its libraries do not load (a failure when it was asked for:
    serve would stop at start)."""
    ports = {
        "http": config.http_port,
        "grpc": config.grpc_port,
        "metrics": config.metrics_port,
    }
    details: dict[str, str] = {}
    busy = []
    grpc_off = _grpc_off(config)
    for name, port in ports.items():
        if port < 0:
            details[name] = "off"
        elif name == "grpc" and grpc_off:
            details[name] = grpc_off
        elif port == 0:
            details[name] = "any free port"
        elif not _bindable(config.host, port, details, name):
            busy.append(f"{name} {port}")
    summary = ", ".join(f"{k} {v}" for k, v in details.items())
    if not busy:
        if grpc_off:
            return Check("ports", FAIL if config.grpc_port_given else WARN, summary, details)
        return Check("ports", OK, summary, details)
    # an appliance already serving (the service itself) is no problem
    if config.http_port > 0 and _answers(config.host, config.http_port, "/v2/health/live"):
        summary = f"in use by a running appliance: {', '.join(busy)}"
        return Check("ports", OK, summary, details)
    return Check("ports", FAIL, f"in use by another program: {', '.join(busy)}", details)


def _bindable(host: str, port: int, details: dict[str, str], name: str) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            details[name] = f"{port} in use ({exc.strerror})"
            return False
    details[name] = f"{port} free"
    return True


def _grpc_off(config: ServerConfig) -> str:
    """'' when the gRPC endpoint can start, else why it cannot and the fix."""
    from appliance.adapters.grpc import libraries as grpc_libraries

    problem = grpc_libraries.load_error() if config.grpc_port >= 0 else None
    if problem is None:
        return ""
    return f"off: the gRPC libraries do not load ({problem}): {grpc_libraries.FIX}"


def _answers(host: str, port: int, path: str) -> bool:
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _reachable(host: str, port: int, timeout: float) -> str:
    """'' when a TCP connection opens, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return ""
    except OSError as exc:
        return exc.strerror or str(exc)


def check_reachability(config: ServerConfig, ota_url: str | None, timeout: float) -> Check:
    targets: dict[str, tuple[str, int]] = {}
    if config.mqtt is not None:
        targets["mqtt broker"] = (config.mqtt.host, config.mqtt.port)
    if ota_url:
        url = urllib.parse.urlsplit(ota_url)
        if url.hostname:
            default = 443 if url.scheme == "https" else 80
            targets["ota source"] = (url.hostname, url.port or default)
    if not targets:
        return Check("network", OK, "no broker or OTA source configured")
    details = {
        name: _reachable(host, port, timeout) or "reachable"
        for name, (host, port) in targets.items()
    }
    down = [
        f"{name} {targets[name][0]}:{targets[name][1]}: {why}"
        for name, why in details.items()
        if why != "reachable"
    ]
    if down:
        # the server serves HTTP and gRPC without them: a warning, not a failure
        return Check("network", WARN, "not reachable: " + "; ".join(down), details)
    return Check("network", OK, ", ".join(f"{k} reachable" for k in details), details)


def check_ota_config(config_path: Path | None) -> Check | None:
    """The update agent's ``ota:`` section, when the config file has one: valid, and its
    source (the only OTA address doctor contacts unless --ota-url names another)."""
    import yaml

    from appliance.ota.config import load

    if config_path is None:
        return None
    try:
        data = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # reported by the config check
        return None
    if not isinstance(data, dict) or "ota" not in data:
        return None
    try:
        source = load(config_path).source
    except ApplianceError as exc:
        return Check("ota", FAIL, f"the update agent will not start: {exc}")
    return Check("ota", OK, f"update agent config valid, source {source}", {"source": source})
