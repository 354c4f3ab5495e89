"""Ed25519 keys for the four TUF roles, kept as PEM files in one folder.

``<dir>/<role>.pem`` holds the private key (mode 0600) and ``<role>.pub.json`` the
public key in TUF's key format. The root key signs only root metadata (rotation);
it is meant to live offline: copy ``root.pem`` off the machine that publishes and
bring it back only to rotate keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from securesystemslib.signer import CryptoSigner, Key, SSlibKey

from appliance.ota import ROLES, OtaError


def _write_private(path: Path, key: Ed25519PrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def generate(keys_dir: Path, roles: tuple[str, ...] = ROLES, replace: bool = False) -> None:
    """Make a new key for each of ``roles``; an existing key is kept unless ``replace``
    (then the old one is kept as ``<role>.old.pem`` until the rotation is published)."""
    keys_dir.mkdir(parents=True, exist_ok=True)
    for role in roles:
        path = keys_dir / f"{role}.pem"
        if path.exists():
            if not replace:
                raise OtaError(f"{path} exists: refusing to overwrite a key")
            os.replace(path, keys_dir / f"{role}.old.pem")
        key = Ed25519PrivateKey.generate()
        _write_private(path, key)
        public = SSlibKey.from_crypto(key.public_key())
        (keys_dir / f"{role}.pub.json").write_text(
            json.dumps({"keyid": public.keyid, **public.to_dict()}, indent=1) + "\n"
        )


def signer(keys_dir: Path, role: str, old: bool = False) -> CryptoSigner:
    """The signer for ``role`` (``old``: the key a rotation replaced)."""
    path = keys_dir / f"{role}{'.old' if old else ''}.pem"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise OtaError(f"cannot read the {role} key {path}: {exc.strerror}") from None
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise OtaError(f"{path}: expected an ed25519 private key")
    return CryptoSigner(key)


def public(keys_dir: Path, role: str) -> Key:
    """The public key of ``role`` (read from its private key)."""
    return signer(keys_dir, role).public_key
