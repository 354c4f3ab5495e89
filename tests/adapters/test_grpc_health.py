"""The standard grpc.health.v1 service, checked on the wire: requests and answers as
the bytes health.proto defines (what grpc_health_probe and Kubernetes send), not
through the server's own message classes."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

SERVING, NOT_SERVING, SERVICE_UNKNOWN = b"\x08\x01", b"\x08\x02", b"\x08\x03"


def _request(service: str) -> bytes:
    """HealthCheckRequest{service}: field 1, length-delimited (short names only)."""
    data = service.encode()
    assert len(data) < 128
    return b"\n" + bytes([len(data)]) + data if data else b""


def test_check_answers_each_service(run_appliance: Any) -> None:
    srv = run_appliance()
    with grpc.insecure_channel(srv.grpc_url) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        assert check(_request(""), timeout=10) == SERVING
        assert check(_request("inference.GRPCInferenceService"), timeout=10) == SERVING
        with pytest.raises(grpc.RpcError) as caught:
            check(_request("no.such.Service"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        listed = channel.unary_unary("/grpc.health.v1.Health/List")(b"", timeout=10)
        # map<string, HealthCheckResponse> statuses = 1: one entry per service, SERVING
        for service in (b"", b"inference.GRPCInferenceService"):
            key = b"\n" + bytes([len(service)]) + service
            entry = key + b"\x12\x02" + SERVING
            assert b"\n" + bytes([len(entry)]) + entry in listed, listed


def test_watch_streams_the_status_and_its_change_at_shutdown(run_appliance: Any) -> None:
    srv = run_appliance()
    with grpc.insecure_channel(srv.grpc_url) as channel:
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
        unknown = watch(_request("no.such.Service"), timeout=30)
        assert next(unknown) == SERVICE_UNKNOWN
        unknown.cancel()
        stream = watch(_request(""), timeout=30)
        assert next(stream) == SERVING
        endpoint = srv.server._grpc
        srv.loop.call_soon_threadsafe(endpoint._health.set, False)  # as stop() does
        assert next(stream) == NOT_SERVING
        stream.cancel()
