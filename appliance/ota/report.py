"""Device reports over MQTT: retained JSON on ``<prefix>/<device_id>/ota``.

A report is the device's whole OTA state, not an event: the job under way (or
none), each model's committed version and the outcome of the last update of each
model. Retained, so a fleet watcher that subscribes later sees exactly what one
that ran all along has (:mod:`appliance.ota.watch`); QoS 1; signed with the device's key
(:mod:`appliance.ota.devicekey`). The broker comes from the server's own ``mqtt:``
section. A broker that is down never holds up an update: reports are best
effort, and the next state change publishes the whole state again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from paho.mqtt.enums import CallbackAPIVersion

from appliance.config.mqtt_config import MqttConfig
from appliance.ota import devicekey
from appliance.ota.state import AgentState, Job

log = logging.getLogger(__name__)


def topic(prefix: str, device_id: str) -> str:
    return f"{prefix}/{device_id}/ota"


RESULTS = ("updated", "rolled_back", "refused", "withdrawn", "error")


def software_of(folder: Path) -> dict[str, Any]:
    """The installed software for a report: ``version`` (the committed env's, else the
    running agent's), the ``sbom_sha256`` of that env's SBOM, and the last software
    job's outcome (``last``) or the job under way (``job``)."""
    from appliance.version import __version__

    try:
        doc = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    version = str(doc.get("committed") or __version__)
    out: dict[str, Any] = {"version": version}
    with contextlib.suppress(OSError):
        sbom = (folder / "envs" / version / "sbom.cdx.json").read_bytes()
        out["sbom_sha256"] = hashlib.sha256(sbom).hexdigest()
    for key in ("last", "job"):
        if isinstance(doc.get(key), dict):
            out[key] = {k: v for k, v in doc[key].items() if k in ("version", "result",
                        "phase", "error")}  # fmt: skip
    return out


def payload(
    device_id: str, state: AgentState, result: str = "", software: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The report. ``model``/``version``: the job under way, else the last finished one;
    ``result``: "" while a job is under way, else that job's outcome (``event`` says
    "error" when this report is about a failed check, not a job); ``results``: the
    last outcome of each model; ``shadow`` the agreement shadow probation measured,
    ``download`` whether it came as a delta and the bytes it saved; ``probe`` the
    kind of probes self-test and probation sent (ota.probes); ``window_opens``
    when a job waits for a maintenance window."""
    job = state.job
    last: dict[str, dict[str, Any]] = {}
    for h in state.history:
        last[str(h.get("model", ""))] = {"version": h.get("version", 0), "result": h.get("result")}
    latest = state.history[-1] if state.history else {}
    return {
        "device_id": device_id,
        "state": state.phase,
        "model": job.model if job else latest.get("model", ""),
        "version": job.version if job else latest.get("version", 0),
        "result": "" if job else str(latest.get("result", "")),
        "event": result,
        "current": {m: s.current for m, s in state.models.items()},
        "results": last,
        "error": state.last_error,
        "time": time.time(),
        # how the job (or the last one) came and what its shadow probation saw
        **{k: v for k in ("shadow", "download", "probe") if (v := _detail(job, latest, k))},
        **({"window_opens": job.window_opens} if job and job.window_opens else {}),
        **({"software": software} if software else {}),
    }


def _detail(job: Job | None, latest: dict[str, Any], key: str) -> Any:
    return getattr(job, key) if job is not None else latest.get(key)


class Reporter:
    """Publishes the agent's report; :meth:`close` waits for the last one (bounded)."""

    def __init__(
        self, config: MqttConfig, device_id: str, key: Ed25519PrivateKey | None = None
    ) -> None:
        self.topic = topic(config.topic_prefix, device_id)
        self._key = key
        self._client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"{device_id}-ota", protocol=mqtt.MQTTv5
        )
        if config.username:
            self._client.username_pw_set(config.username, config.password)
        if config.tls is not None:
            self._client.tls_set(
                ca_certs=str(config.tls.ca_file) if config.tls.ca_file else None,
                certfile=str(config.tls.cert_file) if config.tls.cert_file else None,
                keyfile=str(config.tls.key_file) if config.tls.key_file else None,
            )
        self._connected = threading.Event()
        self._first = True
        self._client.on_connect = lambda *args: self._connected.set()
        self._client.on_disconnect = lambda *args: self._connected.clear()
        self._client.connect_async(config.host, config.port, keepalive=config.keepalive_s)
        self._client.loop_start()

    def publish(self, report: dict[str, Any], wait_s: float = 5.0) -> None:
        """Publish and wait (bounded) for the broker's acknowledgement. Only the first
        report waits for the connection: with the broker down, paho queues QoS 1
        reports and sends them once it connects, and the update goes on meanwhile."""
        if self._first:
            self._first = False
            self._connected.wait(wait_s)
        if self._key is not None:
            report = devicekey.sign(report, self._key)
        info = self._client.publish(self.topic, json.dumps(report), qos=1, retain=True)
        if not self._connected.is_set():
            return
        try:
            info.wait_for_publish(wait_s)
        except (RuntimeError, ValueError) as exc:  # connection lost meanwhile
            log.warning("OTA report not published: %s", exc)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()
