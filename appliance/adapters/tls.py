"""TLS for the HTTP and gRPC endpoints, from one set of server settings.

``tls_cert`` and ``tls_key`` (PEM; the certificate file may hold the whole chain)
turn on HTTPS and gRPC over TLS together: there is no plaintext port beside a TLS
one. ``tls_client_ca`` adds mutual TLS to both: a client must present a
certificate that this CA signed, or the handshake fails before any request is
read. The files are read once at start-up; every problem is a ConfigError naming
the setting.

This module reads files and builds the ``ssl`` context for aiohttp; the gRPC
adapter turns :class:`TlsFiles` into grpc credentials itself (nothing here imports
grpc).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from appliance.config.fields import ConfigError
from appliance.config.server_config import ServerConfig


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM bytes of the server's certificate chain, its key and the client CA."""

    cert: bytes
    key: bytes
    client_ca: bytes | None  # None: clients need no certificate


def _read(path: Path, setting: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError("<server>", setting, f"cannot read {path}: {exc.strerror}") from None


def files(config: ServerConfig) -> TlsFiles | None:
    """The configured TLS material, or None when TLS is off."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    ca = config.tls_client_ca
    return TlsFiles(
        _read(config.tls_cert, "tls_cert"),
        _read(config.tls_key, "tls_key"),
        _read(ca, "tls_client_ca") if ca is not None else None,
    )


def http_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The server-side ``ssl`` context for HTTPS (verifying client certificates when
    ``tls_client_ca`` is set), or None when TLS is off."""
    cert, key, ca = config.tls_cert, config.tls_key, config.tls_client_ca
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("<server>", "tls_cert", f"cannot use {cert} with {key}: {exc}") from None
    if ca is not None:
        try:
            context.load_verify_locations(cafile=str(ca))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                "<server>", "tls_client_ca", f"cannot use {ca} as a CA certificate: {exc}"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context
