"""HTTP/1.1 heads as :mod:`appliance.adapters.http.front` reads and writes them: which
requests it serves itself (:func:`parse`: an inference, ``POST
/v2/models/<m>[/versions/<v>]/infer``, or one of the read-only routes
(:data:`ROUTES`: health, server and model metadata, model readiness and config,
``/metrics``), ``GET`` without a body, each with an ordinary head), and the heads of
its answers (:func:`answer`), and the one head it rewrites before aiohttp reads it
(:func:`chunked_only`: a chunked body that also names a ``Content-Length``).

The rule is strict on purpose: a head is taken only when every byte of it has one
obvious meaning (a request line of exactly that form, HTTP/1.1, well-formed header
lines of printable ASCII, one ``Content-Length`` of digits, no ``Transfer-Encoding``,
``Expect`` or ``Upgrade``, model and version names of plain characters). Anything
else (another route, a chunked body, ``100-continue``, a percent-encoded name, a
folded or odd header, HTTP/1.0, a head over :data:`MAX_HEAD` bytes) is not judged
here: its connection goes to aiohttp, whose parser and routes answer it as they
always have. So this module never has to answer a malformed request, and no request
can mean one thing here and another there.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus

MAX_HEAD = 8192  # bytes of request line and headers this front reads at most

_NAME = rb"([A-Za-z0-9_][A-Za-z0-9_.\-]*)(?:/versions/([0-9]{1,19}))?"
_REQUEST_LINE = re.compile(rb"POST /v2/models/" + _NAME + rb"/infer HTTP/1\.1\r\n")
# the read-only routes: the request target, (its model and version, the route's tail)
_GET_LINE = re.compile(
    rb"GET (/v2/?|/v2/health/(?:live|ready)|/metrics|/v2/models/"
    + _NAME
    + rb"(/ready|/config)?) HTTP/1\.1\r\n"
)
INFER = "infer"
# the read-only routes this module recognizes, by their request target's shape; an
# endpoint serves those it knows and hands the others on
ROUTES = ("live", "ready", "server", "metrics", "model", "model_ready", "model_config")
_FIXED = {b"/v2": "server", b"/v2/": "server", b"/v2/health/live": "live",
          b"/v2/health/ready": "ready", b"/metrics": "metrics"}  # fmt: skip
_TAILS = {None: "model", b"/ready": "model_ready", b"/config": "model_config"}
# a header line: a token, a colon, a value of printable ASCII (tabs allowed inside)
_FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*((?:[!-~][ \t!-~]*)?)\r\n")
# every header line of a head, validated in one match (then read with one findall)
_FIELDS = re.compile(rb"(?:" + _FIELD.pattern + rb")*")
_TRAILING_SPACE = b" \t"
# fields whose presence sends the connection to aiohttp (framing it must decide)
_HANDED = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"te"})


@dataclass(frozen=True, slots=True)
class Head:
    """A request's head, as this front serves it: an inference (``route`` INFER), or
    one of :data:`ROUTES`, whose ``content_length`` is 0."""

    model: str
    version: str
    content_length: int
    header_length: str | None  # Inference-Header-Content-Length, as sent
    authorizations: tuple[str, ...]
    keep_alive: bool  # False when the client said ``Connection: close``
    # every other field (name as sent, value as sent after the colon's whitespace),
    # for the headers forwarded as parameters (adapters/forwarding): :meth:`headers`
    fields: tuple[tuple[bytes, bytes], ...] = ()
    route: str = INFER
    target: str = ""  # a read-only route's request target, as sent

    def headers(self) -> Iterator[tuple[str, str]]:
        """The other fields as text (decoded only when a forwarding pattern reads them)."""
        for name, value in self.fields:
            yield name.decode("ascii"), value.decode("ascii")


def _read_route(head: bytes) -> tuple[str, str, str, str, int] | None:
    """A read-only route's (route, model, version, target, end of the request line), or
    None."""
    line = _GET_LINE.match(head)
    if line is None:
        return None
    target_bytes = line.group(1)
    route = _FIXED.get(target_bytes)
    if route is None:
        model = line.group(2)
        if model == b"stats" and line.group(3) is None and line.group(4) is None:
            return None  # /v2/models/stats: every model's statistics, not a model
        route = _TAILS[line.group(4)]
    name, version = (line.group(2) or b"").decode("ascii"), (line.group(3) or b"").decode("ascii")
    return route, name, version, target_bytes.decode("ascii"), line.end()


def parse(head: bytes) -> Head | None:
    """``head`` (request line and headers, the blank line included) -> its
    :class:`Head`, or None when aiohttp is to serve the request instead."""
    line = _REQUEST_LINE.match(head)
    if line is not None:  # an inference (its target: the model and version)
        route, target, pos = INFER, "", line.end()
        model, version = line.group(1).decode("ascii"), (line.group(2) or b"").decode("ascii")
    else:
        routed = _read_route(head)
        if routed is None:
            return None
        route, model, version, target, pos = routed
    content_length: int | None = None
    header_length: str | None = None
    authorizations: list[str] = []
    fields: list[tuple[bytes, bytes]] = []
    keep_alive = True
    end = len(head) - 2  # the blank line
    if _FIELDS.fullmatch(head, pos, end) is None:
        return None  # folded, empty-named, non-ASCII or malformed: not ours
    for raw_name, raw_value in _FIELD.findall(head, pos, end):
        name = raw_name.lower()
        value = raw_value.rstrip(_TRAILING_SPACE)
        if name == b"content-length":
            if content_length is not None or not value.isdigit() or len(value) > 18:
                return None
            content_length = int(value)
        elif name == b"inference-header-content-length":
            if header_length is not None:
                return None
            header_length = value.decode("ascii")
        elif name == b"authorization":
            authorizations.append(value.decode("ascii"))
        elif name == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")}
            if b"upgrade" in tokens:
                return None
            keep_alive = keep_alive and b"close" not in tokens  # any close closes
        elif name in _HANDED:
            return None
        else:
            fields.append((raw_name, raw_value))
    if route != INFER:  # a GET without a body (one with a body: aiohttp's to judge)
        if content_length or header_length is not None:
            return None
        content_length = 0
    elif content_length is None:
        return None
    return Head(
        model,
        version,
        content_length,
        header_length,
        tuple(authorizations),
        keep_alive,
        tuple(fields),
        route,
        target,
    )


def chunked_only(head: bytes) -> bytes | None:
    """A head framed twice, by ``Transfer-Encoding: chunked`` and a ``Content-Length``
    (as Python's ``requests`` sends a chunked body it was given), rewritten to be
    framed by the chunks alone and to close the connection after its answer: RFC 9112
    lets a server process such a request by its Transfer-Encoding if it then closes,
    so no second request can hide in a body the two framings disagree on. None for
    any other head (left as it is)."""
    fields = head.split(b"\r\n")
    chunked = lengths = 0
    kept = []
    for line in fields[1:-2]:  # between the request line and the blank line
        name, _, value = line.partition(b":")
        key = name.strip().lower()
        if key == b"transfer-encoding":
            if value.strip().lower() != b"chunked":
                return None  # another coding: aiohttp decides
            chunked += 1
        elif key == b"content-length":
            lengths += 1
            continue
        elif key == b"connection":
            continue
        kept.append(line)
    if chunked != 1 or not lengths:
        return None
    return b"\r\n".join([fields[0], *kept, b"Connection: close", b"", b""])


@functools.lru_cache(maxsize=64)
def _status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()


@functools.lru_cache(maxsize=2)
def _date_line(second: int) -> bytes:
    return b"Date: " + formatdate(second, usegmt=True).encode() + b"\r\n"


def answer(
    status: int,
    size: int,
    header_length: int | None,
    keep_alive: bool,
    content_type: bytes = b"application/json",
) -> bytes:
    """The head of an answer of ``size`` body bytes: JSON (or ``content_type``; none
    for an empty body), or binary outputs after a JSON header of ``header_length``
    bytes; ``Connection: close`` unless ``keep_alive``; a 401 names the scheme it
    wants (Bearer)."""
    lines = [_status_line(status)]
    if header_length is None:
        if size:
            lines.append(b"Content-Type: %s\r\n" % content_type)
    else:
        lines.append(b"Content-Type: application/octet-stream\r\n")
        lines.append(b"Inference-Header-Content-Length: %d\r\n" % header_length)
    lines.append(b"Content-Length: %d\r\n" % size)
    lines.append(_date_line(int(time.time())))
    if status == 401:
        lines.append(b"WWW-Authenticate: Bearer\r\n")
    if not keep_alive:
        lines.append(b"Connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)
