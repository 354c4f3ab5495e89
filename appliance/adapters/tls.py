"""TLS for the HTTP and gRPC endpoints, from one set of server settings.

``tls_cert`` and ``tls_key`` (PEM; the certificate file may hold the whole chain)
turn on HTTPS and gRPC over TLS together: there is no plaintext port beside a TLS
one. ``tls_client_ca`` adds mutual TLS to both: a client must present a
certificate that this CA signed, or the handshake fails before any request is
read. The files are read once at start-up; every problem is a ConfigError naming
the setting.

This module builds the ``ssl`` context both endpoints serve with (the gRPC one adds
ALPN ``h2``).
"""

from __future__ import annotations

import ssl

from appliance.config.fields import ConfigError
from appliance.config.server_config import ServerConfig


def http_context(config: ServerConfig) -> ssl.SSLContext | None:
    """A new server-side ``ssl`` context for HTTPS or gRPC (verifying client
    certificates when ``tls_client_ca`` is set), or None when TLS is off."""
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
