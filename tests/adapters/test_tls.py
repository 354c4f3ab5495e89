"""TLS on both endpoints from one set of settings, and mutual TLS: a real server on
loopback, throwaway certificates, tritonclient's own TLS options over HTTP and gRPC."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from docs_examples import examples
from tritonclient.utils import InferenceServerException

from appliance.config.fields import ConfigError
from appliance.config.server_config import load_server_config
from devtools import modelgen

Key = ec.EllipticCurvePrivateKey


def _issue(
    folder: Path, name: str, signer: tuple[x509.Certificate, Key] | None, ca: bool = False
) -> tuple[x509.Certificate, Key]:
    """A certificate for ``name`` (self-signed unless ``signer``), written as
    ``name.pem`` and ``name.key`` in ``folder``."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer, signing_key = (signer[0].subject, signer[1]) if signer else (subject, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = builder.sign(signing_key, hashes.SHA256())
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    """ca (signs server and client), rogue (a self-signed client the server must refuse)."""
    folder = tmp_path / "pki"
    folder.mkdir()
    ca = _issue(folder, "ca", None, ca=True)
    _issue(folder, "server", ca)
    _issue(folder, "client", ca)
    _issue(folder, "rogue", None)
    modelgen.write_model(tmp_path / "repo", "simple", modelgen.simple_add_sub())
    return folder


def _grpc(url: str, pki: Path, client: str = "") -> grpcclient.InferenceServerClient:
    keys = {}
    if client:
        keys = {
            "private_key": str(pki / f"{client}.key"),
            "certificate_chain": str(pki / f"{client}.pem"),
        }
    return grpcclient.InferenceServerClient(
        url, ssl=True, root_certificates=str(pki / "ca.pem"), **keys
    )


def _https(pki: Path, client: str = "") -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client:
        context.load_cert_chain(pki / f"{client}.pem", pki / f"{client}.key")
    return context


def _simple_grpc(client: grpcclient.InferenceServerClient) -> np.ndarray:
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((1, 16), np.int32))
    return client.infer("simple", inputs, client_timeout=30).as_numpy("OUTPUT0")


def test_grpc_uses_the_https_certificate(run_appliance, pki: Path) -> None:
    srv = run_appliance(
        pki.parent / "repo", tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key")
    )
    np.testing.assert_array_equal(_simple_grpc(_grpc(srv.grpc_url, pki)), 2)
    http = httpclient.InferenceServerClient(
        srv.url, ssl=True, ssl_context_factory=lambda: _https(pki)
    )
    assert http.is_model_ready("simple")
    # a plaintext client gets no service on either port
    with pytest.raises(InferenceServerException) as plain:
        grpcclient.InferenceServerClient(srv.grpc_url).is_server_live(client_timeout=10)
    assert "UNAVAILABLE" in plain.value.status()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{srv.url}/v2", timeout=30)
    # nor does a client that trusts someone else
    with pytest.raises(InferenceServerException):
        grpcclient.InferenceServerClient(
            srv.grpc_url, ssl=True, root_certificates=str(pki / "rogue.pem")
        ).is_server_live(client_timeout=10)


def test_mutual_tls_on_both_endpoints(run_appliance, pki: Path) -> None:
    srv = run_appliance(
        pki.parent / "repo",
        tls_cert=str(pki / "server.pem"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.pem"),
    )
    # with a certificate the CA signed: served
    np.testing.assert_array_equal(_simple_grpc(_grpc(srv.grpc_url, pki, "client")), 2)
    http = httpclient.InferenceServerClient(
        srv.url, ssl=True, ssl_context_factory=lambda: _https(pki, "client")
    )
    assert http.is_model_ready("simple")
    # without a client certificate, or with one the CA did not sign: refused
    for who in ("", "rogue"):
        with pytest.raises(InferenceServerException) as refused:
            _grpc(srv.grpc_url, pki, who).is_server_live(client_timeout=10)
        assert "UNAVAILABLE" in refused.value.status(), who
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"https://{srv.url}/v2", timeout=30, context=_https(pki, who))


def test_client_ca_settings_are_checked_at_the_edge(tmp_path: Path, pki: Path) -> None:
    with pytest.raises(ConfigError, match="tls_client_ca: mutual TLS needs tls_cert and tls_key"):
        load_server_config(None, {"tls_client_ca": str(pki / "ca.pem")})
    with pytest.raises(ConfigError, match="tls_client_ca: expected an existing file"):
        load_server_config(
            None,
            {
                "tls_cert": str(pki / "server.pem"),
                "tls_key": str(pki / "server.key"),
                "tls_client_ca": str(tmp_path / "nope.pem"),
            },
        )


def test_failed_handshakes_do_not_hold_connection_slots(run_appliance, pki: Path) -> None:
    """A TLS handshake counts against grpc_max_connections while it lasts (at most
    grpc_read_timeout_s); one that fails gives its slot back (at once on uvloop, within
    the handshake timeout on asyncio), so a burst of refused or garbage handshakes does
    not lock the good clients out, and a client that never starts its handshake is
    dropped."""
    srv = run_appliance(
        pki.parent / "repo",
        tls_cert=str(pki / "server.pem"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.pem"),
        grpc_max_connections=2,
        grpc_read_timeout_s=2.0,
    )
    host, port = srv.grpc_url.rsplit(":", 1)
    for _ in range(4):
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            try:  # a certificate the CA did not sign
                with _https(pki, "rogue").wrap_socket(raw, server_hostname=host) as tls:
                    tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                    tls.recv(1)
            except (ssl.SSLError, OSError):
                pass
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # not TLS at all
            with contextlib.suppress(OSError):
                raw.recv(100)
    silent = socket.create_connection((host, int(port)), timeout=30)
    with silent, contextlib.suppress(ConnectionResetError):  # no ClientHello: closed
        assert silent.recv(100) == b""
    deadline = time.monotonic() + 30
    while srv.server._grpc.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not srv.server._grpc.connections
    for _ in range(2):  # both slots are free
        np.testing.assert_array_equal(_simple_grpc(_grpc(srv.grpc_url, pki, "client")), 2)


def test_the_documented_clients_are_served(run_appliance, pki: Path) -> None:
    """docs/tls.md's two client examples as written, in the folder holding ca.pem,
    client.pem and client.key, the server's addresses put in for device.local's: both
    are served under mutual TLS."""
    srv = run_appliance(
        pki.parent / "repo",
        tls_cert=str(pki / "server.pem"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.pem"),
    )
    grpc_example, http_example = examples("tls.md", "test_the_documented_clients_are_served")
    for example, here, url in (
        (grpc_example, "device.local:8001", srv.grpc_url),
        (http_example, "device.local:8000", srv.url),
    ):
        assert here in example
        done = subprocess.run(
            [sys.executable, "-c", example.replace(here, url)],
            cwd=pki,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "True", done.stdout
