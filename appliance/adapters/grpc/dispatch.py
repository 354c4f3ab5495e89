"""Which call a new gRPC stream gets: the :class:`Dispatcher` of the gRPC endpoint.

For every new HTTP/2 stream it checks the request, answering as grpc-go does: headers
over the advertised list size RESOURCE_EXHAUSTED; a :method other than POST HTTP 405 +
INTERNAL; a content-type that is not ``application/grpc`` (optionally ``+suffix`` or
``;params``) HTTP 415 + INVALID_ARGUMENT; a malformed ``grpc-timeout`` (1-8 ASCII
digits and a unit) HTTP 400 + INTERNAL; an unknown method UNIMPLEMENTED; a
``grpc-encoding`` it cannot read UNIMPLEMENTED with ``grpc-accept-encoding``; then the
caller's token (``authorize``: UNAUTHENTICATED / PERMISSION_DENIED), all from the
HEADERS, before any DATA of the call is kept. A refused call is answered
trailers-only and its stream reset; an accepted one gets a
:class:`~appliance.adapters.grpc.calls.Call` with the method, its deadline, its
metadata (none for a public method) and ``reserve``, which holds each message's
queued bytes from its length prefix on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import grpc

from appliance.adapters.grpc.calls import UNARY, Call, Context, Method, Reserve
from appliance.adapters.grpc.h2.connection import Connection
from appliance.adapters.grpc.h2.frames import Stream
from appliance.adapters.grpc.messages import ENCODINGS, deadline

# (path, authorization values) -> None when the call may run, else its refusal
Authorize = Callable[[str, list[str]], "tuple[grpc.StatusCode, str] | None"]


async def _refused(request: Any, context: Context) -> NoReturn:
    raise AssertionError("a refused call never runs")


_REFUSED = Method(UNARY, _refused, bytes, bytes)


def _grpc_content(content_type: str) -> bool:
    """``application/grpc``, optionally with ``+proto`` (any subtype) or parameters."""
    return content_type == "application/grpc" or content_type.startswith(
        ("application/grpc+", "application/grpc;")
    )


class Dispatcher:
    """The methods by path; opens a :class:`Call` for each new stream
    (:class:`appliance.adapters.grpc.h2.connection.Handler`)."""

    def __init__(
        self,
        methods: dict[str, Method],
        authorize: Authorize | None = None,
        reserve: Reserve | None = None,
    ) -> None:
        self.methods = methods
        self._authorize = authorize
        self._reserve = reserve

    def open(self, connection: Connection, stream: Stream) -> None:
        path = verb = content_type = timeout = ""
        encoding = "identity"
        metadata: list[tuple[str, str]] = []
        tokens: list[str] = []
        for key, value in stream.headers:
            if key[:1] == ":":
                if key == ":path":
                    path = value
                elif key == ":method":
                    verb = value
            elif key == "content-type":
                content_type = value
            elif key == "grpc-timeout":
                timeout = value
            elif key == "grpc-encoding":
                encoding = value
            elif not key.startswith("grpc-") and key != "te":
                metadata.append((key, value))
                if key == "authorization":
                    tokens.append(value)
        stream.headers = []  # read: the call keeps its metadata only
        method = self.methods.get(path)
        code, status, refusal, when = grpc.StatusCode.UNIMPLEMENTED, 200, "", None
        if stream.oversize:
            limit = connection.limits.max_header_list_size
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            refusal = f"request headers of {stream.oversize} bytes, over the limit of {limit}"
        elif verb != "POST":
            code, status = grpc.StatusCode.INTERNAL, 405
            refusal = f"a request with :method {verb[:16]!r}, which should be POST"
        elif not _grpc_content(content_type):
            code, status = grpc.StatusCode.INVALID_ARGUMENT, 415
            refusal = f"invalid gRPC request content-type {content_type[:64]!r}"
        else:
            try:
                when = deadline(timeout)
            except ValueError as exc:
                code, status, refusal = grpc.StatusCode.INTERNAL, 400, str(exc)
        if not refusal:
            if method is None:
                refusal = f"Method not found: {path[:200]}"
            elif encoding not in ENCODINGS:
                refusal = (
                    f"grpc-encoding {encoding[:32]!r} is not supported: "
                    "send identity, gzip or deflate"
                )
            elif self._authorize is not None:  # the token, before any DATA is kept
                denied = self._authorize(path, tokens)
                if denied is not None:
                    code, refusal = denied
        public = method is not None and method.public
        context = Context(() if public else tuple(metadata), when)
        chosen = method if method is not None and not refusal else _REFUSED
        call = Call(connection, stream, chosen, context, encoding, self._reserve)
        stream.call = call
        if refusal:
            call._fail(code, refusal, status, accept=encoding not in ENCODINGS)
