"""Sealed model files, the cryptography: keys, wrapping, sealing and opening.

See :mod:`appliance.backends.sealed` for what the engines call; this module is imported only
when a sealed file is met (or by the fleet tools), so a server without sealed models
needs no ``cryptography``.

A sealed file keeps the model file's own name (``model.onnx``, ``model.plan``, an
OpenVINO ``model.xml`` and its ``model.bin``), so finding the file and choosing the
backend work as for a plain one; its first bytes say it is sealed::

    b"APLSEAL1" | header length (4 bytes, big-endian) | header (JSON) | ciphertext | tag (16)

The header names the cipher, the plaintext size, the nonce and the recipients. One
content key (32 random bytes, one per bundle: every file of a bundle shares it)
encrypts the file with AES-256-GCM, the magic, length and header as associated data,
so a changed header fails exactly like a changed byte of ciphertext. The content key
is wrapped once per recipient, as HPKE's base mode does: X25519 between a fresh
ephemeral key and the recipient's public key, HKDF-SHA256 over the shared secret
(salted with both public keys) to a key-encryption key, AES-256-GCM over the content
key. A recipient is one device's key or a fleet group's key (whose private half each
device of the group holds).

Opening (:func:`open_sealed`) decrypts in memory and returns the plaintext as bytes
for the engine (ONNX Runtime and TensorRT load from bytes, OpenVINO from a memory
buffer); nothing is written to disk, no temporary file. Up to 2 GiB it is one
AES-GCM call straight into the bytes returned; beyond, block by block into one
buffer, zeroed once copied. Sealing (:func:`seal_file`) is the fleet side's,
streamed in blocks.

Private keys are PKCS#8 PEM files that only their owner may read (mode 0600 or
stricter): a key file other users can read is refused, as ssh refuses one.
Public keys travel as one line, ``x25519:<base64 of the 32 raw bytes>``.
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import io
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from appliance.backends.base import SEALED_MAGIC as MAGIC
from appliance.errors import invalid

CIPHER = "X25519-HKDF-SHA256/AES-256-GCM"
_TAG = 16
_BLOCK = 1 << 20  # bytes read or written at a time
_MAX_HEADER = 16 << 20  # a header naming some 100,000 recipients
_ONE_SHOT = (1 << 31) - 1  # what one AESGCM call takes
_WRAP_INFO = b"appliance sealed model v1"
_PUBLIC_PREFIX = "x25519:"


# ---- keys ------------------------------------------------------------------------------


def generate_key(path: Path) -> str:
    """Write a new private key to ``path`` (mode 0600, never over an existing file);
    return its public key line."""
    key = X25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    return public_line(key.public_key())


def load_private_key(path: Path) -> X25519PrivateKey:
    """The private key in ``path``; INVALID_ARG naming the file when it is missing,
    readable by other users, or not an X25519 key."""
    try:
        st = os.stat(path)
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise invalid(
                f"model key {path} is readable by other users (mode "
                f"{stat.S_IMODE(st.st_mode):o}); make it readable by the service user "
                "alone: chmod 600"
            )
        data = path.read_bytes()
    except OSError as exc:
        raise invalid(f"cannot read the model key {path}: {exc.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise invalid(f"model key {path} is not a PEM private key") from None
    if not isinstance(key, X25519PrivateKey):
        raise invalid(f"model key {path} is not an X25519 key")
    return key


def public_line(key: X25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return _PUBLIC_PREFIX + base64.b64encode(raw).decode()


def parse_public(text: str) -> X25519PublicKey:
    """A public key line (``x25519:<base64>``); INVALID_ARG for anything else."""
    text = text.strip()
    try:
        if not text.startswith(_PUBLIC_PREFIX):
            raise ValueError
        raw = base64.b64decode(text[len(_PUBLIC_PREFIX) :], validate=True)
        return X25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise invalid(
            f"not a public key line {text[:60]!r}: expected 'x25519:<base64 of 32 bytes>'"
        ) from None


def key_id(key: X25519PublicKey) -> str:
    """A short name for a public key: the first 8 bytes of its SHA-256, in hex."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


# ---- wrapping the content key -------------------------------------------------------------


def _kek(shared: bytes, ephemeral: bytes, recipient: bytes) -> bytes:
    hkdf = HKDF(hashes.SHA256(), 32, salt=ephemeral + recipient, info=_WRAP_INFO)
    return hkdf.derive(shared)


def _raw(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def wrap(content_key: bytes, recipients: list[X25519PublicKey]) -> list[dict[str, str]]:
    """The content key wrapped for each recipient (the header's ``recipients``)."""
    out = []
    for recipient in recipients:
        ephemeral = X25519PrivateKey.generate()
        epk = _raw(ephemeral.public_key())
        kek = _kek(ephemeral.exchange(recipient), epk, _raw(recipient))
        nonce = os.urandom(12)
        wrapped = AESGCM(kek).encrypt(nonce, content_key, _WRAP_INFO)
        out.append(
            {
                "kid": key_id(recipient),
                "epk": base64.b64encode(epk).decode(),
                "wrapped": base64.b64encode(nonce + wrapped).decode(),
            }
        )
    return out


def _unwrap(header: dict[str, Any], key: X25519PrivateKey, where: str) -> bytes:
    mine = key_id(key.public_key())
    entries = [r for r in header.get("recipients", []) if isinstance(r, dict)]
    for entry in entries:
        if entry.get("kid") != mine:
            continue
        try:
            epk = base64.b64decode(str(entry["epk"]), validate=True)
            blob = base64.b64decode(str(entry["wrapped"]), validate=True)
            shared = key.exchange(X25519PublicKey.from_public_bytes(epk))
            kek = _kek(shared, epk, _raw(key.public_key()))
            return AESGCM(kek).decrypt(blob[:12], blob[12:], _WRAP_INFO)
        except (KeyError, ValueError, InvalidTag):
            raise invalid(f"{where}: its key for this device ({mine}) does not open") from None
    kids = sorted(str(r.get("kid")) for r in entries)
    raise invalid(f"{where} is sealed for key(s) {kids}, not for this device's key {mine}")


# ---- the file ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Header:
    raw: bytes  # magic, length and JSON: the associated data
    doc: dict[str, Any]
    size: int
    nonce: bytes


def _read_header(f: BinaryIO, file_size: int, where: str) -> _Header:
    start = f.read(len(MAGIC) + 4)
    if len(start) < len(MAGIC) + 4 or not start.startswith(MAGIC):
        raise invalid(f"{where} is not a sealed model file")
    length = int.from_bytes(start[len(MAGIC) :], "big")
    if length > min(_MAX_HEADER, file_size):
        raise invalid(f"{where}: its header claims {length} bytes")
    text = f.read(length)
    try:
        doc = json.loads(text)
        size = int(doc["size"])
        nonce = base64.b64decode(str(doc["nonce"]), validate=True)
        if doc.get("cipher") != CIPHER or len(nonce) != 12 or size < 0:
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise invalid(f"{where}: its header is not a sealed-model header ({CIPHER})") from None
    if len(start) + length + size + _TAG != file_size:
        raise invalid(f"{where}: {file_size} bytes, but its header says {size} sealed")
    return _Header(start + text, doc, size, nonce)


def seal_file(src: Path, dst: Path, content_key: bytes, recipients: list[dict[str, str]]) -> None:
    """Write ``src`` sealed with ``content_key`` to ``dst`` (``recipients``: from
    :func:`wrap`), streamed in blocks."""
    size = src.stat().st_size
    nonce = os.urandom(12)
    doc = {
        "format": 1,
        "cipher": CIPHER,
        "size": size,
        "nonce": base64.b64encode(nonce).decode(),
        "recipients": recipients,
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    head = MAGIC + len(text).to_bytes(4, "big") + text
    enc = Cipher(algorithms.AES(content_key), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(head)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(head)
        while block := fin.read(_BLOCK):
            fout.write(enc.update(block))
        fout.write(enc.finalize())
        fout.write(enc.tag)


def open_sealed(path: Path, key: X25519PrivateKey) -> bytes:
    """The plaintext of the sealed file ``path``, decrypted in memory and
    authenticated before it is returned; INVALID_ARG naming the file otherwise."""
    where = f"sealed model file {path.name}"
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        header = _read_header(f, file_size, where)
        content_key = _unwrap(header.doc, key, where)
        if header.size + _TAG <= _ONE_SHOT:  # one call, straight into the bytes returned
            sealed = f.read(header.size + _TAG)
            if len(sealed) != header.size + _TAG:
                raise invalid(f"{where} ends early")
            try:
                return AESGCM(content_key).decrypt(header.nonce, sealed, header.raw)
            except InvalidTag:
                raise invalid(f"{where} failed authentication: changed or damaged") from None
        return _open_streamed(f, header, content_key, where)


def _open_streamed(f: io.BufferedReader, header: _Header, content_key: bytes, where: str) -> bytes:
    """Past what one AES-GCM call takes (2 GiB): block by block into one buffer."""
    dec = Cipher(algorithms.AES(content_key), modes.GCM(header.nonce)).decryptor()
    dec.authenticate_additional_data(header.raw)
    out = bytearray(header.size + 15)  # update_into wants a block of slack
    view, block = memoryview(out), bytearray(_BLOCK)
    done = 0
    try:
        while done < header.size:
            n = f.readinto(memoryview(block)[: min(_BLOCK, header.size - done)])
            if not n:
                raise invalid(f"{where} ends early")
            done += dec.update_into(memoryview(block)[:n], view[done:])
        try:
            dec.finalize_with_tag(f.read(_TAG))
        except (InvalidTag, ValueError):
            raise invalid(f"{where} failed authentication: changed or damaged") from None
        return bytes(view[: header.size])
    finally:
        view.release()
        _zero(out)
        _zero(block)


def _zero(buffer: bytearray) -> None:
    """Overwrite a plaintext buffer before it is freed (best effort: the engine's
    own copy and the returned bytes live on in memory while they are used)."""
    if buffer:
        ctypes.memset((ctypes.c_char * len(buffer)).from_buffer(buffer), 0, len(buffer))


def seal_folder(src: Path, dst: Path, recipients: list[X25519PublicKey]) -> list[str]:
    """Seal every file of the version folder ``src`` into ``dst`` (same relative
    paths) with one content key wrapped for ``recipients``; the key ids."""
    if not recipients:
        raise invalid("sealing needs at least one recipient public key")
    content_key = os.urandom(32)
    wrapped = wrap(content_key, recipients)
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        out = dst / path.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        seal_file(path, out, content_key, wrapped)
    return [w["kid"] for w in wrapped]
