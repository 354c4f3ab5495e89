"""Per-device report signing: each device signs its OTA reports with its own key.

The broker's ACL is the first line (each device may publish only under its own
id, see docs/ota.md); signatures are the second, for brokers shared with other
clients or run by someone else. The agent keeps an ed25519 key in
``<state_dir>/report-key.pem`` (mode 0600, made at its first run) and signs every
report: ``sig`` is the base64 signature of the report's canonical JSON (sorted
keys, no spaces, without ``sig``). The fleet registers each device's public key
(``appliance ota status`` prints it as ``report_key``) as
``<device-keys dir>/<device_id>.pub``; ``appliance fleet watch --device-keys DIR``
counts only reports whose signature verifies with the key of the device the topic
names, and never one older than the last it accepted from that device (a replayed
report).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from appliance.ota import OtaError

KEY_FILE = "report-key.pem"


def canonical(report: dict[str, Any]) -> bytes:
    body = {k: v for k, v in report.items() if k != "sig"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def load(state_dir: Path, create: bool = True) -> Ed25519PrivateKey | None:
    """The device's key (made now when ``create`` and there is none yet)."""
    path = state_dir / KEY_FILE
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError:
        if not create:
            return None
        return _create(path)
    except (OSError, ValueError) as exc:
        raise OtaError(f"cannot read the report key {path}: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise OtaError(f"{path}: expected an ed25519 private key")
    return key


def _create(path: Path) -> Ed25519PrivateKey:
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return key


def public_text(key: Ed25519PrivateKey) -> str:
    """The public key as the fleet registers it: base64 of its 32 raw bytes."""
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def sign(report: dict[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    return {**report, "sig": base64.b64encode(key.sign(canonical(report))).decode()}


def public_key(text: str) -> Ed25519PublicKey:
    try:
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(text.strip(), validate=True))
    except (ValueError, binascii.Error) as exc:
        raise OtaError(f"not an ed25519 public key (base64 of 32 bytes): {exc}") from None


def verify(report: dict[str, Any], key: Ed25519PublicKey) -> bool:
    sig = report.get("sig")
    if not isinstance(sig, str):
        return False
    try:
        key.verify(base64.b64decode(sig, validate=True), canonical(report))
    except (InvalidSignature, ValueError, binascii.Error):
        return False
    return True
