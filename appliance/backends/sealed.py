"""Model files sealed at rest: how an engine gets a model's bytes.

A sealed model file (encrypted to this device's key, see
:mod:`appliance.backends.sealed_crypto` for the format) keeps the model file's name and starts
with :data:`MAGIC`. :func:`read_model` tells a plain file (None: the engine reads
the path itself, as always) from a sealed one, which it opens into memory with the
server's ``model_key_file``: the engine then loads from bytes (ONNX Runtime,
TensorRT) or a memory buffer (OpenVINO), and no plaintext ever reaches the disk.
The cryptography is imported only when a sealed file is met.
"""

from __future__ import annotations

from pathlib import Path

from appliance.backends.base import SEALED_MAGIC as MAGIC
from appliance.errors import invalid


def is_sealed(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def read_model(path: Path, key_file: Path | None) -> bytes | None:
    """The plaintext of ``path`` when it is sealed, opened with the private key in
    ``key_file``; None when it is a plain file the engine reads itself."""
    if not is_sealed(path):
        return None
    if key_file is None:
        raise invalid(
            f"model file {path.name} is sealed (encrypted at rest), but the server has no "
            "model_key_file to open it"
        )
    try:
        from appliance.backends import sealed_crypto  # only for sealed models
    except ImportError:
        raise invalid(
            f"model file {path.name} is sealed: opening it needs the cryptography package "
            "(pip install 'appliance[ota]')"
        ) from None
    return sealed_crypto.open_sealed(path, sealed_crypto.load_private_key(key_file))
