"""Who may do what: the access policy as a pure function, and the token rules end to
end over HTTP and gRPC on loopback (exposure is configured, never bound), plus HTTPS."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tritonclient.utils import InferenceServerException

from appliance.adapters.access import AccessPolicy, Scope, bearer, is_loopback
from appliance.config.fields import ConfigError
from appliance.config.server_config import ServerConfig, load_server_config
from devtools import modelgen

ADMIN, INFER = "admin-secret", "camera-secret"


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("::", False),  # every IPv6 interface
        ("192.0.2.10", False),
        ("10.1.2.3", False),
        ("fe80::1", False),
        ("appliance.local", False),  # a name we cannot judge counts as exposed
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_bearer_parsing() -> None:
    assert bearer("Bearer abc") == "abc"
    assert bearer("bearer  abc ") == "abc"
    assert bearer("Basic abc") is None
    assert bearer("Bearer ") is None
    assert bearer(None) is None


def test_the_policy_decides_by_scope_token_and_exposure() -> None:
    open_local = AccessPolicy.from_config(ServerConfig())
    assert open_local.check(Scope.ADMIN, None) is None  # loopback, no token: open
    assert open_local.check(Scope.INFERENCE, None) is None

    exposed = AccessPolicy.from_config(ServerConfig(host="192.0.2.10"))
    denial = exposed.check(Scope.ADMIN, "Bearer anything")
    assert denial is not None and denial.forbidden
    assert "listens on 192.0.2.10" in denial.message and "set admin_token" in denial.message
    assert exposed.check(Scope.INFERENCE, None) is None  # inference: open unless a token
    assert exposed.check(Scope.PUBLIC, None) is None

    guarded = AccessPolicy.from_config(
        ServerConfig(host="192.0.2.10", admin_token=ADMIN, inference_token=INFER)
    )
    assert guarded.check(Scope.ADMIN, f"Bearer {ADMIN}") is None
    for wrong in (None, "Bearer nope", f"Bearer {INFER}", ADMIN):
        denial = guarded.check(Scope.ADMIN, wrong)
        assert denial is not None and not denial.forbidden and "admin token" in denial.message
    assert guarded.check(Scope.INFERENCE, f"Bearer {INFER}") is None
    assert guarded.check(Scope.INFERENCE, f"Bearer {ADMIN}") is None  # admin may infer too
    assert guarded.check(Scope.INFERENCE, None) is not None
    assert guarded.check(Scope.PUBLIC, None) is None  # health stays open for probes

    # a token configured is required on loopback too; require_admin_token without one
    # refuses admin calls there as if exposed
    assert AccessPolicy.from_config(ServerConfig(admin_token=ADMIN)).check(
        Scope.ADMIN, None
    ) == guarded.check(Scope.ADMIN, None)
    required = AccessPolicy.from_config(ServerConfig(require_admin_token=True))
    denial = required.check(Scope.ADMIN, None)
    assert denial is not None and denial.forbidden


def _request(
    url: str, body: dict[str, Any] | None = None, token: str | None = None
) -> tuple[int, str, dict[str, str]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def _simple_body() -> dict[str, Any]:
    data = list(range(16))
    return {
        "inputs": [
            {"name": n, "datatype": "INT32", "shape": [1, 16], "data": data}
            for n in ("INPUT0", "INPUT1")
        ]
    }


def test_tokens_over_http(run_appliance, tmp_path: Path) -> None:
    modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    srv = run_appliance(tmp_path, admin_token=ADMIN, inference_token=INFER)
    base = f"http://{srv.url}/v2"
    load = f"{base}/repository/models/simple/load"

    status, body, headers = _request(load, {})
    assert status == 401 and "needs an admin token" in body
    assert headers["WWW-Authenticate"] == "Bearer"
    assert _request(load, {}, token="wrong")[0] == 401
    assert _request(load, {}, token=INFER)[0] == 401  # the inference token is not admin
    assert _request(load, {}, token=ADMIN)[0] == 200
    assert _request(f"{base}/systemsharedmemory/region/r/register", {}, token=INFER)[0] == 401

    infer = f"{base}/models/simple/infer"
    status, body, _ = _request(infer, _simple_body())
    assert status == 401 and "needs an inference token" in body
    assert _request(f"{base}/models/simple", token=None)[0] == 401  # metadata too
    status, body, _ = _request(infer, _simple_body(), token=INFER)
    assert status == 200 and json.loads(body)["outputs"][0]["data"][0] == 0
    assert _request(infer, _simple_body(), token=ADMIN)[0] == 200
    assert _request(f"{base}/health/ready")[0] == 200  # probes need no token
    assert _request(base)[0] == 200

    # tritonclient sends the header as given
    client = httpclient.InferenceServerClient(srv.url)
    with pytest.raises(InferenceServerException, match="needs an admin token"):
        client.unload_model("simple", headers={"Authorization": f"Bearer {INFER}"})
    client.unload_model("simple", headers={"Authorization": f"Bearer {ADMIN}"})
    assert not client.is_model_ready("simple", headers={"Authorization": f"Bearer {INFER}"})


def test_admin_calls_are_refused_when_exposed_without_a_token(
    run_appliance, tmp_path: Path
) -> None:
    modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    # the same policy as a non-loopback bind, on 127.0.0.1: tests never bind elsewhere
    srv = run_appliance(tmp_path, require_admin_token=True, shared_memory="system")
    base = f"http://{srv.url}/v2"
    for path in (
        "repository/models/simple/load",
        "repository/models/simple/unload",
        "systemsharedmemory/region/r/register",
        "systemsharedmemory/unregister",
    ):
        status, body, _ = _request(f"{base}/{path}", {}, token="anything")
        assert status == 403, path
        assert "no admin_token is configured" in body and "set admin_token" in body
    status, body, _ = _request(f"{base}/models/simple/infer", _simple_body())
    assert status == 200  # inference is not an admin call
    assert _request(f"{base}/repository/index", {})[0] == 200  # reading the index is not

    client = grpcclient.InferenceServerClient(srv.grpc_url)
    with pytest.raises(InferenceServerException, match="no admin_token is configured") as info:
        client.load_model("simple")
    assert info.value.status() == "StatusCode.PERMISSION_DENIED"
    assert client.is_model_ready("simple")


def test_tokens_over_grpc(run_appliance, tmp_path: Path) -> None:
    modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    srv = run_appliance(tmp_path, admin_token=ADMIN, inference_token=INFER)
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    admin = {"authorization": f"Bearer {ADMIN}"}
    camera = {"authorization": f"Bearer {INFER}"}
    assert client.is_server_live() and client.is_server_ready()  # open for probes

    with pytest.raises(InferenceServerException, match="needs an admin token") as info:
        client.load_model("simple", headers=camera)
    assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    client.load_model("simple", headers=admin)

    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(np.ones((1, 16), np.int32))
    with pytest.raises(InferenceServerException, match="needs an inference token") as info:
        client.infer("simple", inputs)
    assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    result = client.infer("simple", inputs, headers=camera)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2))

    # the bidirectional stream is checked the same way
    answers: list[Any] = []
    client.start_stream(callback=lambda result, error: answers.append(error))
    # the server may end the stream before the request is even sent
    with contextlib.suppress(InferenceServerException):
        client.async_stream_infer("simple", inputs)
    client.stop_stream()
    assert answers and all("needs an inference token" in str(e) for e in answers), answers


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A throwaway self-signed certificate for 127.0.0.1."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "appliance test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_https_with_the_configured_certificate(run_appliance, tmp_path: Path) -> None:
    modelgen.write_model(tmp_path / "repo", "simple", modelgen.simple_add_sub())
    cert, key = _certificate(tmp_path)
    srv = run_appliance(tmp_path / "repo", tls_cert=str(cert), tls_key=str(key), admin_token=ADMIN)
    trusted = ssl.create_default_context(cafile=str(cert))
    request = urllib.request.Request(
        f"https://{srv.url}/v2/repository/models/simple/load",
        data=b"{}",
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    with urllib.request.urlopen(request, timeout=30, context=trusted) as response:
        assert response.status == 200
    client = httpclient.InferenceServerClient(
        srv.url, ssl=True, ssl_context_factory=lambda: trusted
    )
    assert client.is_model_ready("simple")
    with pytest.raises(urllib.error.URLError):  # the wrong trust fails the handshake
        urllib.request.urlopen(f"https://{srv.url}/v2", timeout=30)
    with pytest.raises(OSError):  # and plain HTTP gets no answer
        urllib.request.urlopen(f"http://{srv.url}/v2", timeout=30)


def test_tls_settings_are_checked_at_the_edge(tmp_path: Path) -> None:
    cert, _ = _certificate(tmp_path)
    with pytest.raises(ConfigError, match="tls_key: HTTPS needs both tls_cert and tls_key"):
        load_server_config(None, {"tls_cert": str(cert)})
    with pytest.raises(ConfigError, match="tls_key: expected an existing file"):
        load_server_config(None, {"tls_cert": str(cert), "tls_key": str(tmp_path / "nope")})


def test_every_http_route_declares_its_scope_and_an_undeclared_one_is_admin(
    run_appliance, tmp_path: Path
) -> None:
    from aiohttp import web

    from appliance.adapters.http import api

    modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    srv = run_appliance(tmp_path, admin_token=ADMIN, inference_token=INFER)
    policy = AccessPolicy.from_config(srv.server.config)
    app = api.create_app(srv.server.dataplane, 1 << 20, policy)
    scopes = app[api.SCOPES]
    routes = list(app.router.routes())
    assert routes and all(route in scopes for route in routes)  # nothing left to a default
    by_path = {(r.method, r.resource.canonical): scopes[r] for r in routes if r.resource}
    assert by_path[("GET", "/v2/health/ready")] is Scope.PUBLIC
    assert by_path[("HEAD", "/v2/models/{model}")] is Scope.INFERENCE
    assert by_path[("POST", "/v2/repository/models/{model}/load")] is Scope.ADMIN

    async def extra(request: web.Request) -> web.Response:
        return web.Response(text="ran")

    app.router.add_get("/v2/extra", extra)  # registered without a scope: admin

    async def serve() -> tuple[web.AppRunner, int]:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    runner, port = srv.call(serve())
    try:
        url = f"http://127.0.0.1:{port}/v2/extra"
        assert _request(url)[0] == 401
        status, body, _ = _request(url, token=INFER)
        assert status == 401 and "needs an admin token" in body
        assert _request(url, token=ADMIN)[:2] == (200, "ran")
        # the declared scopes hold on this app too, HEAD included
        head = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/simple", method="HEAD")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(head, timeout=30)
        assert info.value.code == 401
        assert _request(f"http://127.0.0.1:{port}/v2/health/live")[0] == 200
        # an unknown path is still a plain 404 to a caller holding an inference token
        assert _request(f"http://127.0.0.1:{port}/v2/nowhere", token=INFER)[0] == 404
    finally:
        srv.call(runner.cleanup())


def test_every_grpc_rpc_declares_its_scope_and_an_undeclared_one_is_admin() -> None:
    from tritonclient.grpc import service_pb2

    from appliance.adapters.grpc import health_proto
    from appliance.adapters.grpc import services as grpc_server

    services = (
        health_proto.DESCRIPTOR.services_by_name["Health"],
        service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
    )
    methods = {f"/{s.full_name}/{m.name}" for s in services for m in s.methods}
    assert methods == set(grpc_server.RPC_SCOPES)  # every RPC declared, none made up
    assert grpc_server.rpc_scope("/inference.GRPCInferenceService/ModelInfer") is Scope.INFERENCE
    assert grpc_server.rpc_scope("/grpc.health.v1.Health/Check") is Scope.PUBLIC
    assert grpc_server.rpc_scope("/inference.GRPCInferenceService/LogSettings") is Scope.ADMIN
    assert grpc_server.rpc_scope("/inference.GRPCInferenceService/SomethingNew") is Scope.ADMIN
    assert grpc_server.rpc_scope("/some.Other/Service") is Scope.ADMIN
