"""The gRPC endpoint's services are imported with its first connection
(:class:`appliance.adapters.grpc.server.GrpcEndpoint`): when they cannot load then (a
protobuf runtime that does not match the generated code), the waiting connection is
closed with a GOAWAY, the log says why, HTTP goes on serving, and the next connection
tries again.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

SERVICES = "appliance.adapters.grpc.services"


def _ready(url: str) -> bool:
    with grpcclient.InferenceServerClient(url) as client:
        return bool(client.is_server_ready())


def test_services_that_cannot_load_refuse_the_call_and_the_next_connection_tries_again(
    run_appliance: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    srv = run_appliance()
    monkeypatch.setitem(sys.modules, SERVICES, None)  # its import raises ImportError
    with caplog.at_level(logging.ERROR), pytest.raises(InferenceServerException) as refused:
        _ready(srv.grpc_url)
    assert "UNAVAILABLE" in str(refused.value)
    assert any("the gRPC libraries do not load" in r.getMessage() for r in caplog.records)
    http = httpclient.InferenceServerClient(srv.url)
    x = np.ones((1, 16), dtype=np.int32)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(x)
    assert (http.infer("simple", inputs).as_numpy("OUTPUT0") == 2).all()  # HTTP serves
    monkeypatch.undo()
    assert _ready(srv.grpc_url)  # a new connection loads them
