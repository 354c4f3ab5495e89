"""The ``mqtt:`` section of the server configuration (appliance.yaml), validated into
:class:`MqttConfig` for the MQTT bridge (appliance/adapters/mqtt/bridge.py) and the OTA
agent's reports; :func:`appliance.config.server_config.load_server_config` calls
:func:`parse_mqtt`."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from appliance.config.fields import ConfigError, Fields, existing_path, seconds

# ---- mqtt: the MQTT bridge (appliance/adapters/mqtt/bridge.py) ----------------------------------


@dataclass(frozen=True, slots=True)
class MqttTls:
    ca_file: Path | None = None  # None: the system's trusted CAs
    cert_file: Path | None = None  # client certificate (mutual TLS), with key_file
    key_file: Path | None = None


@dataclass(frozen=True, slots=True)
class MqttConfig:
    """The ``mqtt:`` section of appliance.yaml (see docs/mqtt.md for each field)."""

    host: str
    port: int = 1883
    device_id: str = ""  # default: the host name
    client_id: str = ""  # default: the device id
    topic_prefix: str = "appliance"
    qos: int = 1  # subscriptions and replies: 0 or 1
    models: tuple[str, ...] = ()  # () = every model
    shared_group: str = ""  # also serve $share/<group>/<prefix>/infer/<model>
    username: str = ""
    password: str = ""
    tls: MqttTls | None = None
    keepalive_s: int = 30
    session_expiry_s: int = 300  # the broker keeps our subscriptions and QoS 1 requests
    max_pending: int = 64  # requests held at once (v5 Receive Maximum); beyond: "overloaded"
    dedup_window_s: float = 60.0
    dedup_max_entries: int = 10000
    # a device on the LAN of its broker is back within ~1-2 s of the broker's return
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 2.0
    file_directory: Path | None = None  # payloads may name files under it; None: refused


def _topic_level(f: Fields, key: str, default: str, allow_slash: bool = False) -> str:
    """A topic part we publish or subscribe with: no wildcards, no empty levels."""
    value = f.text(key, default)
    if (
        not value
        or value.startswith("$")
        or any(c in value for c in "+#\0")
        or (not allow_slash and "/" in value)
        or "" in value.split("/")
    ):
        what = "topic prefix (levels separated by '/')" if allow_slash else "topic level"
        raise f.fail(
            key,
            f"expected a non-empty MQTT {what} without '+', '#', empty levels "
            f"or a leading '$', got {value!r}",
        )
    return value


def parse_mqtt(f: Fields, path: Path | None, broker: str | None) -> MqttConfig | None:
    """The ``mqtt`` section, or None when it is absent and --mqtt-broker is not given."""
    raw = f.data.get("mqtt")
    if raw is None and broker is None:
        return None
    m = Fields(f.source, {} if raw is None else raw, f.at("mqtt"))
    m.check_keys(set(MqttConfig.__slots__))  # every field is a key of the section
    data = dict(m.data)
    if broker is not None:
        name, sep, number = str(broker).rpartition(":")
        if not sep or not name or not number.isdigit() or not 0 < int(number) < 65536:
            raise ConfigError(
                "<command line>", "--mqtt-broker", f"expected HOST:PORT, got {broker!r}"
            )
        data.update(host=name.strip("[]"), port=int(number))
    m = Fields(m.source, data, m.path)
    host = m.text("host")
    if not host:
        raise m.fail("host", "expected the broker's host name or address")
    port = m.integer("port", 1883, minimum=1)
    if port > 65535:
        raise m.fail("port", f"expected a port number 1..65535, got {port}")
    qos = m.integer("qos", 1)
    if qos > 1:
        raise m.fail("qos", f"expected 0 or 1, got {qos}")
    models = data.get("models", [])
    if not isinstance(models, list) or not all(
        isinstance(x, str) and x and not set(x) & set("+#/\0") for x in models
    ):
        raise m.fail("models", f"expected a list of model names, got {models!r}")
    device_id = _topic_level(m, "device_id", socket.gethostname() or "appliance")
    tls = None
    if isinstance(data.get("tls"), bool):  # tls: true = the system's trusted CAs
        tls = MqttTls() if data["tls"] else None
    elif (t := m.sub("tls")) is not None:
        t.check_keys(set(MqttTls.__slots__))
        files = [existing_path(t, key, path) for key in MqttTls.__slots__]
        tls = MqttTls(*files)
        if (tls.cert_file is None) != (tls.key_file is None):
            raise t.fail("cert_file", "a client certificate needs both cert_file and key_file")
    low = seconds(m, "reconnect_min_s", 0.5, 0.01)
    high = seconds(m, "reconnect_max_s", max(2.0, low), low)
    shared = data.get("shared_group") or ""
    return MqttConfig(
        host=host,
        port=port,
        device_id=device_id,
        client_id=m.text("client_id", device_id) or device_id,
        topic_prefix=_topic_level(m, "topic_prefix", "appliance", allow_slash=True),
        qos=qos,
        models=tuple(models),
        shared_group=_topic_level(m, "shared_group", shared) if shared else "",
        username=m.text("username"),
        password=m.text("password"),
        tls=tls,
        keepalive_s=m.integer("keepalive_s", 30, minimum=5),
        session_expiry_s=m.integer("session_expiry_s", 300),
        max_pending=m.integer("max_pending", 64, minimum=1),
        dedup_window_s=seconds(m, "dedup_window_s", 60.0, 0.0),
        dedup_max_entries=m.integer("dedup_max_entries", 10000, minimum=1),
        reconnect_min_s=low,
        reconnect_max_s=high,
        file_directory=existing_path(m, "file_directory", path, directory=True),
    )
