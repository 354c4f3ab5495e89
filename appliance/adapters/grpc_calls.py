"""gRPC calls over :mod:`appliance.adapters.grpc_h2`: methods, messages, status, deadlines.

A :class:`Dispatcher` holds the methods by path (``/package.Service/Method``), each
with its kind (unary, client+server streaming, server streaming) and how its
messages are read and written. For every new HTTP/2 stream it checks the request
(``POST``, a gRPC content type, no compression it cannot read, a known method),
then a :class:`Call` runs the method's coroutine with a :class:`Context` (the part
of grpcio's ``ServicerContext`` the servicers use: ``invocation_metadata`` and
``abort``) and writes the answer: response headers, the messages, then the
trailers with ``grpc-status`` (a call that fails before it answered gets one
"trailers-only" HEADERS frame, as gRPC's protocol says).

Compressed requests (``grpc-encoding`` gzip or deflate) are inflated within the
message limit; responses go uncompressed (every client reads those).
Status codes are grpcio's ``grpc.StatusCode``; a ``grpc-timeout`` becomes the call's
deadline (DEADLINE_EXCEEDED when it passes); a message over the server's limit is
RESOURCE_EXHAUSTED; a client that resets its stream cancels the call.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from appliance.adapters.grpc_frames import END_HEADERS, END_STREAM, HEADERS, Stream, frame
from appliance.adapters.grpc_h2 import Connection

log = logging.getLogger(__name__)

UNARY, STREAM, SERVER_STREAM = "unary", "stream", "server_stream"
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC: its kind, its coroutine (or async generator function) and how its
    messages are read (bytes -> request) and written (response -> bytes)."""

    kind: str
    behavior: Callable[..., Any]
    parse: Callable[[bytes], Any]
    write: Callable[[Any], bytes]
    framed: bool = False  # write() returns the message with its 5-byte gRPC prefix


class Abort(Exception):
    """Ends a call with a status (raised by :meth:`Context.abort`)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Context:
    """What a servicer method sees of its call."""

    __slots__ = ("_metadata", "deadline")

    def __init__(self, metadata: tuple[tuple[str, str], ...], deadline: float | None) -> None:
        self._metadata = metadata
        self.deadline = deadline

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise Abort(code, details)


def _hpack_int(value: int, prefix: int, first: int) -> bytes:
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header as a literal without indexing, new name, no Huffman coding."""
    return b"\x00" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value


def _percent(text: str) -> bytes:
    """grpc-message's percent-encoding: printable ASCII but '%' stays as it is."""
    raw = text.encode("utf-8", "replace")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)


# :status 200 (static index 8) and content-type (static name 31) application/grpc
_RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + _hpack_int(16, 7, 0) + b"application/grpc"
_OK_TRAILERS = _literal(b"grpc-status", b"0")


def _trailers(code: grpc.StatusCode, details: str) -> bytes:
    block = _literal(b"grpc-status", str(code.value[0]).encode())
    if details:
        block += _literal(b"grpc-message", _percent(details))
    return block


def headers_frame(stream_id: int, block: bytes, end: bool) -> bytes:
    return frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), stream_id, block)


def message(payload: bytes | memoryview) -> bytes:
    """One gRPC length-prefixed message (not compressed)."""
    return struct.pack(">BI", 0, len(payload)) + bytes(payload)


# grpc-encoding -> zlib's wbits (gzip's header, or zlib's as gRPC's "deflate")
_ENCODINGS = {"identity": 0, "gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _decompress(data: bytes, encoding: str, limit: int) -> bytes:
    """A compressed message, inflated to at most ``limit`` bytes (ValueError past it)."""
    if encoding == "identity":
        raise zlib.error("the message is flagged compressed but grpc-encoding is identity")
    inflate = zlib.decompressobj(_ENCODINGS[encoding])
    out = inflate.decompress(data, limit + 1)
    if len(out) > limit or inflate.unconsumed_tail:
        raise ValueError(f"Received message larger than max (more than {limit} bytes inflated)")
    return out


def _deadline(value: str | None) -> float | None:
    if not value or value[-1] not in _TIMEOUT_UNITS or not value[:-1].isdigit():
        return None
    return time.monotonic() + int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]


class Call:
    """One RPC on one stream: reads its messages, runs its method, writes the answer."""

    __slots__ = (
        "_connection",
        "_context",
        "_encoding",
        "_headed",
        "_inbox",
        "_messages",
        "_method",
        "_started",
        "_stream",
        "_task",
        "_timer",
        "unary",
    )

    def __init__(
        self,
        connection: Connection,
        stream: Stream,
        method: Method,
        context: Context,
        encoding: str = "identity",
    ):
        self._connection = connection
        self._encoding = encoding
        self._stream = stream
        self._method = method
        self._context = context
        self.unary = method.kind != STREAM
        self._messages: list[bytes] = []
        self._inbox: asyncio.Queue[bytes | None] | None = None
        self._started = False
        self._headed = False  # response headers sent: a status now goes in trailers
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None  # the deadline, when it has one
        if method.kind == STREAM:
            self._inbox = asyncio.Queue()
            self._start()

    # ---- told by the connection ------------------------------------------------------

    def message(self, data: bytes, compressed: int) -> None:
        if compressed:
            try:
                data = _decompress(data, self._encoding, self._connection.max_message)
            except ValueError as exc:
                self._fail(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
                self._connection.reset(self._stream)
                return
            except zlib.error as exc:
                self._fail(grpc.StatusCode.INTERNAL, f"a compressed message is corrupt: {exc}")
                return
        if self._inbox is not None:
            self._inbox.put_nowait(data)
        else:
            self._messages.append(data)

    def end(self, leftover: bool) -> None:
        if leftover:
            self._fail(grpc.StatusCode.INTERNAL, "the stream ended inside a message")
        elif self._inbox is not None:
            self._inbox.put_nowait(None)
        elif not self._started:
            if len(self._messages) != 1:
                count = len(self._messages)
                self._fail(grpc.StatusCode.UNIMPLEMENTED, f"a unary call got {count} messages")
            else:
                self._start()

    def too_large(self, size: int) -> None:
        limit = self._connection.max_message
        self._fail(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Received message larger than max ({size} vs. {limit})",
        )
        self._connection.reset(self._stream)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _expire(self) -> None:
        self._close(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if self._task is not None and not self._task.done():
            self._task.cancel()

    # ---- running -----------------------------------------------------------------------

    def _start(self) -> None:
        self._started = True
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        self._connection.calls.add(self._task)
        self._task.add_done_callback(self._connection.calls.discard)
        left = self._context.time_remaining()
        if left is not None:
            self._timer = loop.call_later(left, self._expire)

    async def _run(self) -> None:
        method, context = self._method, self._context
        try:
            if method.kind == UNARY:
                response = await method.behavior(method.parse(self._messages[0]), context)
                payload = method.write(response)
                self._answer(payload if method.framed else message(payload))
                return
            if method.kind == SERVER_STREAM:
                responses = method.behavior(method.parse(self._messages[0]), context)
            else:
                responses = method.behavior(self._requests(), context)
            self._head()
            async for response in responses:
                self._send(message(method.write(response)))
                await self._connection.drain()
            self._close(grpc.StatusCode.OK, "")
        except Abort as exc:
            self._close(exc.code, exc.details)
        except asyncio.CancelledError:
            self._close(grpc.StatusCode.CANCELLED, "the call was cancelled")
            raise
        except Exception as exc:  # a bug: answer and keep serving
            log.exception("unhandled error in gRPC call")
            self._close(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}")
        finally:
            if self._timer is not None:
                self._timer.cancel()

    async def _requests(self) -> AsyncIterator[Any]:
        assert self._inbox is not None
        while (data := await self._inbox.get()) is not None:
            self._connection.consumed(self._stream, len(data) + 5)
            yield self._method.parse(data)

    # ---- writing -----------------------------------------------------------------------

    def _answer(self, framed: bytes) -> None:
        """A unary answer: headers, the message and the trailers in one write."""
        sid = self._stream.id
        head = headers_frame(sid, _RESPONSE_HEADERS, False)
        self._connection.send(
            self._stream, head, framed, headers_frame(sid, _OK_TRAILERS, True), True
        )

    def _head(self) -> None:
        self._headed = True
        head = headers_frame(self._stream.id, _RESPONSE_HEADERS, False)
        self._connection.send(self._stream, head, b"", b"", False)

    def _send(self, data: bytes) -> None:
        self._connection.send(self._stream, b"", data, b"", False)

    def _close(self, code: grpc.StatusCode, details: str) -> None:
        """The call's status: in trailers after the response headers, else alone
        ("trailers-only", which carries the response headers too)."""
        if self._stream.closed:
            return
        block = _OK_TRAILERS if code is grpc.StatusCode.OK else _trailers(code, details)
        if not self._headed:
            block = _RESPONSE_HEADERS + block
        tail = headers_frame(self._stream.id, block, True)
        self._connection.send(self._stream, b"", b"", tail, True)

    def _fail(self, code: grpc.StatusCode, details: str) -> None:
        self.cancel()
        self._close(code, details)


async def _refused(request: Any, context: Context) -> NoReturn:
    raise AssertionError("a refused call never runs")


_REFUSED = Method(UNARY, _refused, bytes, bytes)


class Dispatcher:
    """The methods by path; opens a :class:`Call` for each new stream
    (:class:`appliance.adapters.grpc_h2.Handler`)."""

    def __init__(self, methods: dict[str, Method]) -> None:
        self.methods = methods

    def open(self, connection: Connection, stream: Stream) -> None:
        path = verb = content_type = timeout = ""
        encoding = "identity"
        metadata: list[tuple[str, str]] = []
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
        method = self.methods.get(path)
        refusal = ""
        if verb != "POST" or not content_type.startswith("application/grpc"):
            refusal = f"not a gRPC request: {verb} {path} ({content_type or 'no content-type'})"
        elif method is None:
            refusal = f"Method not found: {path}"
        elif encoding not in _ENCODINGS:
            refusal = f"grpc-encoding '{encoding}' is not supported: send identity, gzip or deflate"
        context = Context(tuple(metadata), _deadline(timeout))
        chosen = method if method is not None and not refusal else _REFUSED
        call = Call(connection, stream, chosen, context, encoding)
        stream.call = call
        if refusal:
            call._fail(grpc.StatusCode.UNIMPLEMENTED, refusal)
