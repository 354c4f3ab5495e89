"""The ``ota:`` section of ``appliance.yaml``, validated once into :class:`OtaConfig`.

The agent reads the same file the server reads: the server's address, model
repository, admin token, memory limit and MQTT broker come from the top level,
so the two can never disagree. Errors name the file and the field.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from appliance.config.fields import ConfigError, Fields, parse_size
from appliance.config.mqtt_config import MqttConfig
from appliance.config.server_config import load_server_config
from appliance.ota import OtaError, window
from appliance.ota.rollout import CHANNELS, check_name


@dataclass(frozen=True, slots=True)
class OtaConfig:
    source: str  # the TUF repository's base URL: metadata/ and targets/ below it
    trusted_root: Path  # the pinned root metadata shipped with the device
    state_dir: Path
    server: str  # the local appliance's HTTP base URL
    model_repository: Path
    device_id: str
    groups: tuple[str, ...] = ()
    channel: str = "stable"
    check_interval_s: float = 300.0
    jitter: float = 0.2  # each wait is check_interval_s * (1 +- jitter), uniformly
    probation_s: float = 60.0
    probation_poll_s: float = 1.0
    max_error_rate: float = 0.01  # the model's own failures / answered requests in probation
    probation_min_requests: int = 5  # answered requests probation needs, or it fails (0: none)
    probe_timeout_s: float = 10.0  # a probation probe unanswered for this long is a failure
    max_latency_ratio: float = 3.0  # new mean latency over the old one's; 0: off
    max_latency_ms: float = 0.0  # absolute ceiling on the new mean latency; 0: off
    keep_versions: int = 2
    max_bandwidth: int = 0  # bytes/s while downloading; 0: unlimited
    min_download_rate: int = 1024  # bytes/s over download_rate_window_s, or the attempt ends
    download_rate_window_s: float = 60.0
    job_deadline_s: float = 7 * 86400.0  # a download not finished by then is dropped
    reserve_disk: int = 32 << 20  # free space the agent always leaves on each file system
    max_bundle_bytes: int = 4 << 30
    max_load_attempts: int = 2  # loads of one version interrupted before it is marked bad
    server_wait_s: float = 120.0  # a cycle waits this long for the server before a load
    admin_token: str = ""
    memory_limit: int | None = None
    mqtt: MqttConfig | None = None
    request_timeout_s: float = 300.0
    metrics_url: str = ""  # the server's metrics page ("": off): probation's 4xx split
    metadata_timeout_s: float = 30.0  # a metadata fetch silent this long fails (socket timeout)
    # when an update may be applied (ota.window); downloads happen any time. (): always
    maintenance_windows: tuple[str, ...] = ()
    maintenance_timezone: str = "UTC"
    # software updates (ota.abinstall): how the server is restarted after a flip, how
    # long it has to come up READY, and how the versioned venvs are made
    restart_command: tuple[str, ...] = ("systemctl", "restart", "appliance")
    software_ready_timeout_s: float = 120.0
    # once READY and self-tested, how long the new server must keep answering as its
    # version with its models READY before the commit (0: commit at once)
    software_probation_s: float = 30.0
    system_site_packages: bool = False  # venvs see the image's packages (JetPack's)
    software_python: str = sys.executable

    def windows(self) -> window.Windows:
        return window.parse(self.maintenance_windows, self.maintenance_timezone)


RESTART = "systemctl restart appliance"


def _number(f: Fields, key: str, default: float, minimum: float) -> float:
    value = f.data.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < minimum:
        raise f.fail(key, f"expected a number >= {minimum:g}, got {value!r}")
    return float(value)


KEYS = {
    "source", "trusted_root", "state_dir", "server", "device_id", "groups", "channel",
    "check_interval_s", "jitter", "probation_s", "probation_poll_s", "max_error_rate",
    "probation_min_requests", "probe_timeout_s", "max_latency_ratio", "max_latency_ms",
    "keep_versions", "max_bandwidth", "min_download_rate", "download_rate_window_s",
    "job_deadline_s", "reserve_disk", "max_bundle_size", "max_load_attempts", "server_wait_s",
    "request_timeout_s", "metadata_timeout_s", "maintenance_windows", "maintenance_timezone",
    "restart_command", "software_ready_timeout_s", "software_probation_s",
    "system_site_packages", "software_python",
}  # fmt: skip


def load(path: Path) -> OtaConfig:
    """Read ``path``; ConfigError naming the file and field for anything wrong."""
    server = load_server_config(path, {})
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    raw = data.get("ota")
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "ota", "expected a mapping (the update agent's settings)")
    f = Fields(str(path), raw, "ota")
    f.check_keys(KEYS)
    source = f.text("source")
    if not source.startswith(("http://", "https://")):
        raise f.fail("source", f"expected an http(s):// URL, got {source!r}")
    base = path.parent

    def local(key: str, default: str = "") -> Path:
        value = f.text(key, default)
        if not value:
            raise f.fail(key, "required")
        p = Path(os.path.expanduser(value))
        return p if p.is_absolute() else base / p

    host = "127.0.0.1" if server.host in ("0.0.0.0", "::", "") else server.host
    default_server = f"http://{host}:{server.http_port}"
    metrics = f"http://{host}:{server.metrics_port}/metrics" if server.metrics_port > 0 else ""
    device_id = f.text("device_id", socket.gethostname().split(".")[0])
    try:
        check_name(device_id, "device_id")
        groups = tuple(check_name(g, "group") for g in f.data.get("groups") or [])
    except (OtaError, TypeError) as exc:
        raise f.fail("device_id/groups", str(exc)) from None
    channel = f.text("channel", "stable")
    if channel not in CHANNELS:
        raise f.fail("channel", f"expected one of {', '.join(CHANNELS)}, got {channel!r}")
    jitter = _number(f, "jitter", 0.2, 0.0)
    if jitter >= 1:
        raise f.fail("jitter", "expected a fraction below 1")
    bandwidth = f.data.get("max_bandwidth", 0)
    min_rate = f.data.get("min_download_rate", "1KiB")
    reserve = f.data.get("reserve_disk", "32MiB")
    windows = f.data.get("maintenance_windows") or []
    if not isinstance(windows, list) or not all(isinstance(w, str) for w in windows):
        raise f.fail("maintenance_windows", "expected a list of '[days ]HH:MM-HH:MM' strings")
    timezone = f.text("maintenance_timezone", "UTC")
    try:
        window.parse(windows, timezone)
    except OtaError as exc:
        raise f.fail("maintenance_windows", str(exc)) from None
    repository = server.model_repository
    if repository is None:
        raise ConfigError(str(path), "model_repository", "the update agent needs one")
    return OtaConfig(
        source=source if source.endswith("/") else source + "/",
        trusted_root=local("trusted_root"),
        state_dir=local("state_dir", "/var/lib/appliance/ota"),
        server=f.text("server", default_server).rstrip("/"),
        model_repository=repository,
        device_id=device_id,
        groups=groups,
        channel=channel,
        check_interval_s=_number(f, "check_interval_s", 300.0, 0.0),
        jitter=jitter,
        probation_s=_number(f, "probation_s", 60.0, 0.0),
        probation_poll_s=_number(f, "probation_poll_s", 1.0, 0.01),
        max_error_rate=_number(f, "max_error_rate", 0.01, 0.0),
        probation_min_requests=f.integer("probation_min_requests", 5, minimum=0),
        probe_timeout_s=_number(f, "probe_timeout_s", 10.0, 0.01),
        max_latency_ratio=_number(f, "max_latency_ratio", 3.0, 0.0),
        max_latency_ms=_number(f, "max_latency_ms", 0.0, 0.0),
        keep_versions=f.integer("keep_versions", 2, minimum=1),
        max_bandwidth=parse_size(bandwidth, str(path), "ota.max_bandwidth") if bandwidth else 0,
        min_download_rate=(
            parse_size(min_rate, str(path), "ota.min_download_rate") if min_rate else 0
        ),
        download_rate_window_s=_number(f, "download_rate_window_s", 60.0, 0.1),
        job_deadline_s=_number(f, "job_deadline_s", 7 * 86400.0, 1.0),
        reserve_disk=parse_size(reserve, str(path), "ota.reserve_disk") if reserve else 0,
        max_bundle_bytes=parse_size(
            f.data.get("max_bundle_size", "4GiB"), str(path), "ota.max_bundle_size"
        ),
        max_load_attempts=f.integer("max_load_attempts", 2, minimum=1),
        server_wait_s=_number(f, "server_wait_s", 120.0, 0.0),
        admin_token=server.admin_token,
        memory_limit=server.memory_limit,
        mqtt=server.mqtt,
        request_timeout_s=_number(f, "request_timeout_s", 300.0, 1.0),
        metrics_url=metrics,
        metadata_timeout_s=_number(f, "metadata_timeout_s", 30.0, 0.1),
        maintenance_windows=tuple(windows),
        maintenance_timezone=timezone,
        restart_command=tuple(shlex.split(f.text("restart_command", RESTART))),
        software_ready_timeout_s=_number(f, "software_ready_timeout_s", 120.0, 1.0),
        software_probation_s=_number(f, "software_probation_s", 30.0, 0.0),
        system_site_packages=f.flag("system_site_packages", False),
        software_python=f.text("software_python", sys.executable),
    )
