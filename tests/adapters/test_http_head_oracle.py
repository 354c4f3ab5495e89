"""``http_head.parse`` against llhttp (``httptools``, the parser Node.js and uvicorn
use) as the oracle: every head the front takes must be a head llhttp reads without
error and with the same meaning (method, path, HTTP/1.1, Content-Length, each
Authorization and Inference-Header-Content-Length value, keep-alive).

The corpus: hand-written heads at the edges of the rule (white space, case, repeated
and odd fields, framing fields, versions, names), and seeded mutations of valid heads
(bytes flipped, inserted, deleted, duplicated: bounded in number). A head the front
refuses goes to aiohttp, so only what it accepts is compared; that it accepts the
plain ones is asserted too (a rule that took nothing would pass otherwise).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from appliance.adapters.http import head as http_head

httptools = pytest.importorskip("httptools")

MUTANTS = 20000


class _Seen:
    """What llhttp reports of one head."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.parser: Any = None
        self.keep_alive = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.complete = True  # (asked now: a message that completes resets the flags)
        self.keep_alive = self.parser.should_keep_alive()


def _oracle(head: bytes) -> tuple[_Seen, Any] | None:
    seen = _Seen()
    parser = seen.parser = httptools.HttpRequestParser(seen)
    try:
        parser.feed_data(head)
    except httptools.HttpParserError:
        return None
    return (seen, parser) if seen.complete else None


def _head(*fields: str, line: str = "POST /v2/models/simple/infer HTTP/1.1") -> bytes:
    return ("\r\n".join([line, *fields]) + "\r\n\r\n").encode("latin-1")


BASE = [
    _head("Host: x", "Content-Length: 10"),
    _head("Content-Length: 0", "Authorization: Bearer abc", "Connection: close"),
    _head(
        "Host: 127.0.0.1:8000",
        "Content-Type: application/octet-stream",
        "Inference-Header-Content-Length: 120",
        "Content-Length: 4096",
        "Connection: keep-alive",
        "Authorization: Bearer t0k3n",
    ),
    _head("content-length: 7", line="POST /v2/models/a.b-c_d/versions/12/infer HTTP/1.1"),
    # the read-only routes (GET, no body)
    _head("Host: x", line="GET /v2/health/ready HTTP/1.1"),
    _head("Host: x", "Authorization: Bearer t", line="GET /v2/models/simple/config HTTP/1.1"),
    _head("Connection: close", line="GET /v2/models/a.b/versions/3/ready HTTP/1.1"),
    _head("Accept: text/plain", "Content-Length: 0", line="GET /metrics HTTP/1.1"),
    _head(line="GET /v2 HTTP/1.1"),
]
EDGES = [
    _head("Content-Length:10"),
    _head("Content-Length:  10  "),
    _head("Content-Length:\t10\t"),
    _head("Content-Length: 010"),
    _head("Content-Length: +10"),
    _head("Content-Length: -1"),
    _head("Content-Length: 1 0"),
    _head("Content-Length: 99999999999999999999"),
    _head("Content-Length: 10", "Content-Length: 10"),
    _head("Content-Length: 10", "Content-Length: 11"),
    _head("Content-Length : 10"),
    _head(" Content-Length: 10"),
    _head("Content-Length: 10", " folded"),
    _head("Content-Length: 10", "X-A: b\tc"),
    _head("Content-Length: 10", "X-A: \x80"),
    _head("Content-Length: 10", "X-A: a\x00b"),
    _head("Content-Length: 10", "X-A: a\x7fb"),
    _head("Content-Length: 10", ": empty name"),
    _head("Content-Length: 10", "X-A:"),
    _head("Content-Length: 10", "X-A: "),
    _head("Content-Length: 10", "Transfer-Encoding: chunked"),
    _head("Content-Length: 10", "Transfer-Encoding: identity"),
    _head("Content-Length: 10", "Expect: 100-continue"),
    _head("Content-Length: 10", "Upgrade: h2c", "Connection: Upgrade"),
    _head("Content-Length: 10", "Connection: Close"),
    _head("Content-Length: 10", "Connection: keep-alive, close"),
    _head("Content-Length: 10", "Connection: foo,  close "),
    _head("Content-Length: 10", "Connection: closed"),
    _head("Content-Length: 10", "Connection: close", "Connection: keep-alive"),
    _head("Content-Length: 10", "TE: trailers"),
    _head("Content-Length: 10", "Authorization: Bearer a", "Authorization: Bearer b"),
    _head("Content-Length: 10", "Authorization: Bearer  spaced  "),
    _head("Content-Length: 10", "Inference-Header-Content-Length: 5"),
    _head("Content-Length: 10", "Inference-Header-Content-Length: x"),
    _head(
        "Content-Length: 10",
        "inference-header-content-length: 1",
        "Inference-Header-Content-Length: 2",
    ),
    _head("Content-Length: 10", line="POST /v2/models/simple/infer HTTP/1.0"),
    _head("Content-Length: 10", line="POST /v2/models/simple/infer HTTP/2.0"),
    _head("Content-Length: 10", line="post /v2/models/simple/infer HTTP/1.1"),
    _head("Content-Length: 10", line="POST  /v2/models/simple/infer HTTP/1.1"),
    _head("Content-Length: 10", line="POST /v2/models/simple/infer  HTTP/1.1"),
    _head("Content-Length: 10", line="POST /v2/models/simple/infer?x=1 HTTP/1.1"),
    _head("Content-Length: 10", line="POST /v2/models/sim%70le/infer HTTP/1.1"),
    _head("Content-Length: 10", line="POST /v2/models/../infer HTTP/1.1"),
    _head("Content-Length: 10", line="POST /v2/models/simple/versions/01/infer HTTP/1.1"),
    _head("Content-Length: 10", line="POST http://x/v2/models/simple/infer HTTP/1.1"),
    _head("Content-Length: 1", line="GET /v2/health/ready HTTP/1.1"),
    _head(line="GET /v2/health/ready?x HTTP/1.1"),
    _head(line="GET /v2/models/stats HTTP/1.1"),
    _head(line="GET /v2/models/simple/stats HTTP/1.1"),
    _head("Transfer-Encoding: chunked", line="GET /v2 HTTP/1.1"),
    _head(line="HEAD /v2 HTTP/1.1"),
    _head(line="GET /v2/models/simple/versions/1/config HTTP/1.0"),
    b"POST /v2/models/simple/infer HTTP/1.1\nContent-Length: 10\n\n",
    b"POST /v2/models/simple/infer HTTP/1.1\r\nContent-Length: 10\n\r\n",
    b"POST /v2/models/simple/infer HTTP/1.1\r\nContent-Length: 10\r\n\n",
    b"POST /v2/models/simple/infer HTTP/1.1\rContent-Length: 10\r\n\r\n",
]


def _mutants(count: int) -> list[bytes]:
    rng = random.Random(20261204)
    alphabet = b" \t\r\n:,;\x00\x7f\x80\xff0123456789aAzZ-_./%+\"'"
    out = []
    for _ in range(count):
        head = bytearray(rng.choice(BASE))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(head) - 4)  # (the blank line stays the end)
            kind = rng.randrange(4)
            if kind == 0:
                head[at] = rng.choice(alphabet)
            elif kind == 1:
                head.insert(at, rng.choice(alphabet))
            elif kind == 2:
                del head[at]
            else:
                end = min(len(head) - 4, at + rng.randint(1, 24))
                head[at:at] = head[at:end]
        out.append(bytes(head))
    return out


def _agree(head: bytes) -> None:
    ours = http_head.parse(head)
    if ours is None:
        return  # aiohttp serves it: not this front's to judge
    got = _oracle(head)
    assert got is not None, f"the front takes a head llhttp refuses: {head!r}"
    seen, parser = got
    assert parser.get_http_version() == "1.1", head
    fields: dict[bytes, list[bytes]] = {}
    for name, value in seen.headers:
        fields.setdefault(name, []).append(value.strip(b" \t"))
    if ours.route == http_head.INFER:
        assert parser.get_method() == b"POST", head
        path = "/v2/models/" + ours.model + (f"/versions/{ours.version}" if ours.version else "")
        assert seen.url == (path + "/infer").encode(), (head, seen.url)
    else:  # a read-only route: GET, its target, no body
        assert parser.get_method() == b"GET", head
        assert seen.url == ours.target.encode(), (head, seen.url)
        if ours.model:
            assert f"/v2/models/{ours.model}/".encode() in seen.url + b"/", head
        fields.setdefault(b"content-length", [b"0"])
    assert [int(v) for v in fields[b"content-length"]] == [ours.content_length], head
    assert [v.decode() for v in fields.get(b"authorization", [])] == list(ours.authorizations)
    length = fields.get(b"inference-header-content-length")
    assert (length[0].decode() if length else None) == ours.header_length, head
    assert seen.keep_alive == ours.keep_alive, head


def test_the_plain_heads_are_taken_and_read_alike() -> None:
    for head in BASE:
        assert http_head.parse(head) is not None, head
        _agree(head)


@pytest.mark.parametrize("head", EDGES, ids=range(len(EDGES)))
def test_an_edge_the_front_takes_means_the_same_to_llhttp(head: bytes) -> None:
    _agree(head)


def test_mutated_heads_the_front_takes_mean_the_same_to_llhttp() -> None:
    taken = 0
    for head in _mutants(MUTANTS):
        _agree(head)
        taken += http_head.parse(head) is not None
    assert taken > 100  # the corpus reaches the rule's acceptance, not only its refusals
