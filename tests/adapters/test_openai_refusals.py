"""The OpenAI routes answer the front's own refusals (a missing token, a body over the
server's limit, a route that does not exist under them) in OpenAI's error shape, so
the ``openai`` client reads them as it reads the routes' own errors. Any model serves
here: these refusals come before a model is looked at."""

from __future__ import annotations

import http.client
import json
from typing import Any

import openai
import pytest

TOKEN = "s3cret-token"


@pytest.fixture
def server(run_appliance: Any) -> Any:
    return run_appliance(inference_token=TOKEN, grpc_port=-1, max_request_size="1MiB")


def _raw(url: str, method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest(method, path)
    for k, v in headers.items():
        conn.putheader(k, v)
    conn.endheaders()
    answer = conn.getresponse()
    doc = json.loads(answer.read())
    conn.close()
    return answer.status, doc


def test_the_openai_client_reads_a_missing_token_as_an_authentication_error(
    server: Any,
) -> None:
    client = openai.OpenAI(base_url=f"http://{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.models.list()
    assert refused.value.status_code == 401
    body: Any = refused.value.body
    assert body["type"] == "authentication_error" and body["code"] == "invalid_api_key"
    assert "token" in body["message"]
    good = openai.OpenAI(base_url=f"http://{server.url}/v1", api_key=TOKEN, max_retries=0)
    assert good.models.list().data == []  # no model serves text here: an empty list


def test_a_body_over_the_limit_is_refused_in_openais_shape(server: Any) -> None:
    status, doc = _raw(
        server.url,
        "POST",
        "/v1/completions",
        {"Authorization": f"Bearer {TOKEN}", "Content-Length": str(2**30),
         "Content-Type": "application/json"},
    )  # fmt: skip
    assert status == 413
    error = doc["error"]
    assert error["type"] == "invalid_request_error" and "max_request_size" in error["message"]
    # a KServe route of the same server keeps KServe's shape
    status, doc = _raw(
        server.url,
        "POST",
        "/v2/models/simple/infer",
        {"Authorization": f"Bearer {TOKEN}", "Content-Length": str(2**30)},
    )
    assert status == 413 and isinstance(doc["error"], str)
