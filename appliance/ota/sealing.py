"""The fleet's side of sealed bundles: model files encrypted at rest to device keys.

``appliance bundle build --seal-to KEY`` (repeatable) seals every file of the version
folder with one content key drawn for this bundle, wrapped for each recipient
(:mod:`appliance.backends.sealed_crypto` holds the format and the cryptography). A recipient
is one device's public key or a fleet group's, whose private half every device of
the group holds. ``KEY`` is a public key line (``x25519:<base64>``, as
``appliance ota model-key`` prints it) or a file of such lines (``#`` comments
allowed), e.g. a group's list of devices.

Only engines that load a model from memory can open a sealed file: ONNX Runtime,
OpenVINO and TensorRT. A Python model is code the interpreter imports from its
files, and an ensemble has no files of its own: both are refused here, before
anything is published. A sealed bundle is not reproducible (each build draws a new
content key) and has no delta (its ciphertext does not diff).
"""

from __future__ import annotations

from pathlib import Path

from appliance.errors import ApplianceError
from appliance.ota import OtaError

SEALABLE = ("onnxruntime", "openvino", "tensorrt")
MAX_RECIPIENTS = 10_000


def recipients(args: tuple[str, ...]) -> list[str]:
    """The public key lines ``args`` name: lines themselves, or files of lines."""
    lines: list[str] = []
    for arg in args:
        if arg.startswith("x25519:"):
            lines.append(arg)
            continue
        try:
            text = Path(arg).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise OtaError(
                f"--seal-to {arg}: not a public key line, nor a file of them: {exc}"
            ) from None
        found = [s for s in (line.split("#", 1)[0].strip() for line in text.splitlines()) if s]
        if not found:
            raise OtaError(f"--seal-to {arg}: the file holds no public key line")
        lines += found
    if len(lines) > MAX_RECIPIENTS:
        raise OtaError(f"a bundle is sealed to at most {MAX_RECIPIENTS} keys, not {len(lines)}")
    return lines


def seal_version(src: Path, dst: Path, backend: str, keys: tuple[str, ...]) -> tuple[str, ...]:
    """Seal the files of the version folder ``src`` into ``dst`` for the keys named
    by ``keys`` (see :func:`recipients`); the recipients' key ids, sorted."""
    if backend not in SEALABLE:
        raise OtaError(
            f"a {backend} model cannot be sealed: only {', '.join(SEALABLE)} load a model "
            "from memory"
        )
    from appliance.backends import sealed_crypto  # the cryptography package, only when sealing

    try:
        publics = [sealed_crypto.parse_public(line) for line in recipients(keys)]
        ids = sealed_crypto.seal_folder(src, dst, publics)
    except ApplianceError as exc:
        raise OtaError(f"sealing {src}: {exc}") from None
    return tuple(sorted(set(ids)))


def model_key(path: Path) -> str:
    """The public key line of the device (or group) key in ``path``, made now (mode
    0600) when there is none: ``appliance ota model-key``."""
    from appliance.backends import sealed_crypto

    try:
        if not path.exists():
            return sealed_crypto.generate_key(path)
        return sealed_crypto.public_line(sealed_crypto.load_private_key(path).public_key())
    except ApplianceError as exc:
        raise OtaError(str(exc)) from None
    except OSError as exc:
        raise OtaError(f"cannot write the key {path}: {exc.strerror or exc}") from None
