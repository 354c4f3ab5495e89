"""gRPC calls over :mod:`appliance.adapters.grpc.h2.connection`: methods, messages,
status, deadlines.

A :class:`Method` is one RPC: its kind (unary, client+server streaming, server
streaming) and how its messages are read and written; which call a new stream gets,
and the refusals from its HEADERS, are :mod:`appliance.adapters.grpc.dispatch`'s. A
:class:`Call` admits each message from its length prefix (its size, its queued bytes),
then runs the method's
coroutine with a :class:`Context` (the part of grpcio's ``ServicerContext`` the
servicers use: ``invocation_metadata`` and ``abort``) and writes the answer: response
headers, the messages, then the trailers with ``grpc-status`` (a call that fails before
it answered gets one "trailers-only" HEADERS frame, as gRPC's protocol says).

Compressed requests (``grpc-encoding`` gzip or deflate) are inflated within the
message limit when the call reads them (:func:`grpc_messages.inflate`); a compressed
flag other than 0 or 1, or 1 without an encoding, is INTERNAL; responses go
uncompressed (every client reads those). Status codes are grpcio's
``grpc.StatusCode``; a ``grpc-timeout`` becomes the call's deadline
(DEADLINE_EXCEEDED when it passes); a message over the server's limit is
RESOURCE_EXHAUSTED, answered from its length prefix before it is read; a unary call
with a second message is INTERNAL at once; a client that resets its stream cancels
the call.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

import grpc

from appliance.adapters.grpc.h2.connection import ADMITTED, OVER, REFUSED, Connection
from appliance.adapters.grpc.h2.frames import Stream
from appliance.adapters.grpc.messages import (
    OK_TRAILERS,
    RESPONSE_HEADERS,
    TooLarge,
    headers_frame,
    inflate,
    message,
    response_headers,
    trailers,
)
from appliance.core.queue_bytes import Hold
from appliance.errors import ApplianceError

log = logging.getLogger(__name__)

UNARY, STREAM, SERVER_STREAM = "unary", "stream", "server_stream"
# the largest request message of a method anyone may call without a token (health,
# liveness, server metadata: their requests are a few bytes)
PUBLIC_MESSAGE = 4096

# a message's size -> a hold of that many queued bytes (ApplianceError when it does
# not fit): DataPlane.reserve
Reserve = Callable[[int], Hold]


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC: its kind, its coroutine (or async generator function) and how its
    messages are read (bytes -> request) and written (response -> bytes)."""

    kind: str
    behavior: Callable[..., Any]
    parse: Callable[[bytes], Any]
    write: Callable[[Any], bytes]
    framed: bool = False  # write() returns the message with its 5-byte gRPC prefix
    # the method takes each request as Held(request, hold) and releases the hold itself
    # once it has answered that request (else the call releases it when it ends)
    held: bool = False
    # anyone may call it (no token): its request is at most PUBLIC_MESSAGE bytes, and
    # the call keeps none of its metadata
    public: bool = False


class Held(NamedTuple):
    """A request message and the queued bytes taken for it when its length prefix came
    (None when the endpoint keeps no count): released once the request is answered."""

    request: Any
    hold: Hold | None


class Refused(NamedTuple):
    """A streamed request refused before its message was kept (its queued bytes did not
    fit): what a ``held`` streaming method gets in its place, to answer in the stream."""

    error: ApplianceError


class Abort(Exception):
    """Ends a call with a status (raised by :meth:`Context.abort`)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


# what a unary method returns once it has answered through Context.answer
ANSWERED: Any = object()


class Context:
    """What a servicer method sees of its call."""

    __slots__ = ("_metadata", "answer", "deadline")

    def __init__(self, metadata: tuple[tuple[str, str], ...], deadline: float | None) -> None:
        self._metadata = metadata
        self.deadline = deadline
        # a unary call's answer, written now (the method then returns ANSWERED): what
        # it holds can be let go once its answer is written
        self.answer: Callable[[Any], None] = _unanswerable

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise Abort(code, details)


class Call:
    """One RPC on one stream: reads its messages, runs its method, writes the answer."""

    __slots__ = (
        "_connection",
        "_context",
        "_encoding",
        "_headed",
        "_hold",
        "_inbox",
        "_messages",
        "_method",
        "_reserve",
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
        reserve: Reserve | None = None,
    ):
        self._connection = connection
        self._reserve = reserve
        self._hold: Hold | None = None  # the queued bytes of the message arriving now
        self._encoding = encoding
        self._stream = stream
        self._method = method
        self._context = context
        self.unary = method.kind != STREAM
        # (message, compressed flag, its hold): a unary call's one request
        self._messages: list[tuple[bytes, int, Hold | None]] = []
        # a streaming call's requests, or in place of one its refusal
        self._inbox: asyncio.Queue[tuple[bytes, int, Hold | Refused | None] | None] | None
        self._inbox = None
        self._started = False
        self._headed = False  # response headers sent: a status now goes in trailers
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None  # the deadline, when it has one
        if method.kind == STREAM:
            self._inbox = asyncio.Queue()
            self._start()

    # ---- told by the connection ------------------------------------------------------

    def admit(self, size: int) -> int:
        """A message of ``size`` bytes begins: its length prefix came, none of it is
        kept yet. Over the method's limit: RESOURCE_EXHAUSTED; else its queued bytes
        are held. When they do not fit: a ``held`` streaming method gets the refusal as
        that request (:class:`Refused`, it answers in its stream, which goes on) and the
        message is dropped as it arrives (REFUSED); any other call ends UNAVAILABLE.
        ADMITTED: keep it; OVER: the call has answered (what the client still sends
        on the stream is dropped)."""
        if self._inbox is None and (self._messages or self._started):
            self._fail(grpc.StatusCode.INTERNAL, "a unary call got more than one request message")
            return OVER  # (at its prefix: the second message is never kept)
        limit = PUBLIC_MESSAGE if self._method.public else self._connection.max_message
        if size > limit:
            self.too_large(size, limit)
            return OVER
        if self._reserve is not None and not self._stream.closed:
            try:
                self._hold = self._reserve(size)
            except ApplianceError as exc:
                if self._inbox is not None and self._method.held:
                    self._inbox.put_nowait((b"", 0, Refused(exc)))
                    return REFUSED
                self._fail(grpc.StatusCode.UNAVAILABLE, exc.message)
                return OVER
        return ADMITTED

    def message(self, data: bytes, compressed: int) -> None:
        hold, self._hold = self._hold, None
        if compressed > 1:
            self._fail(grpc.StatusCode.INTERNAL, f"a message with the compressed flag {compressed}")
        elif compressed and self._encoding == "identity":
            self._fail(
                grpc.StatusCode.INTERNAL,
                "a message flagged compressed, but the call has no grpc-encoding",
            )
        elif self._inbox is not None:
            self._inbox.put_nowait((data, compressed, hold))
            return
        elif self._messages or self._started:
            self._fail(grpc.StatusCode.INTERNAL, "a unary call got more than one request message")
        else:
            self._messages.append((data, compressed, hold))
            return
        if hold is not None:
            hold.release()

    def end(self, leftover: bool) -> None:
        if leftover:
            self._fail(grpc.StatusCode.INTERNAL, "the stream ended inside a message")
        elif self._inbox is not None:
            self._inbox.put_nowait(None)
        elif not self._started:
            if not self._messages:
                self._fail(grpc.StatusCode.INTERNAL, "a unary call ended without its request")
            else:
                self._start()

    def too_large(self, size: int, limit: int) -> None:
        self._fail(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Received message larger than max ({size} vs. {limit})",
        )
        self._connection.reset(self._stream)

    def cancel(self) -> asyncio.Task[None] | None:
        """Stop the call and give back the queued bytes of the messages it holds; its
        task when it is still unwinding."""
        if self._timer is not None:
            self._timer.cancel()
        self._release()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            return self._task
        return None

    def _release(self) -> None:
        """Give back the holds of every message the call still keeps (a message handed
        to a ``held`` method is the method's to release)."""
        if self._hold is not None:
            self._hold.release()
        for _, _, hold in self._messages:
            if hold is not None:
                hold.release()
        inbox = self._inbox
        while inbox is not None and not inbox.empty():
            item = inbox.get_nowait()
            if item is not None and isinstance(item[2], Hold):
                item[2].release()
            elif item is None:  # the end of the requests stays for the reader
                inbox.put_nowait(None)
                break

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

    async def _inflated(self, data: bytes) -> Any:
        """A compressed request message inflated, then parsed."""
        try:
            data = await inflate(data, self._encoding, self._connection.max_message)
        except TooLarge as exc:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except zlib.error as exc:
            details = f"a compressed message is corrupt: {exc}"
            raise Abort(grpc.StatusCode.INTERNAL, details) from None
        return self._method.parse(data)

    async def _run(self) -> None:
        method, context = self._method, self._context
        try:
            if method.kind != STREAM:  # one request (a plain one is parsed without an await)
                data, compressed, hold = self._messages[0]
                self._messages[0] = (b"", 0, hold)  # the request owns the bytes now
                request = await self._inflated(data) if compressed else method.parse(data)
                del data
                if method.held:
                    request = Held(request, hold)
            if method.kind == UNARY:
                context.answer = self._deliver
                response = await method.behavior(request, context)
                if response is not ANSWERED:
                    self._deliver(response)
                return
            if method.kind == SERVER_STREAM:
                responses = method.behavior(request, context)
            else:
                responses = method.behavior(self._requests(), context)
            self._head()
            async for response in responses:
                self._send(message(method.write(response)))
                await self._connection.drain(self._stream)
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
            if self._messages:  # a unary call's request is answered (or never will be)
                hold = self._messages[0][2]
                if hold is not None:
                    hold.release()

    async def _requests(self) -> AsyncIterator[Any]:
        assert self._inbox is not None
        held = self._method.held
        while (item := await self._inbox.get()) is not None:
            data, compressed, hold = item
            if isinstance(hold, Refused):  # (its bytes were dropped, not held)
                yield Held(hold, None)
                continue
            self._connection.consumed(self._stream, len(data) + 5)
            try:
                request = await self._inflated(data) if compressed else self._method.parse(data)
            except BaseException:
                if hold is not None:
                    hold.release()
                raise
            if held:
                yield Held(request, hold)
                continue
            if hold is not None:
                hold.release()
            yield request

    # ---- writing -----------------------------------------------------------------------

    def _deliver(self, response: Any) -> None:
        """A unary method's response, written with its status."""
        payload = self._method.write(response)
        self._answer(payload if self._method.framed else message(payload))

    def _answer(self, framed: bytes) -> None:
        """A unary answer: headers, the message and the trailers in one write."""
        sid = self._stream.id
        head = headers_frame(sid, RESPONSE_HEADERS, False)
        self._connection.send(
            self._stream, head, framed, headers_frame(sid, OK_TRAILERS, True), True
        )

    def _head(self) -> None:
        self._headed = True
        head = headers_frame(self._stream.id, RESPONSE_HEADERS, False)
        self._connection.send(self._stream, head, b"", b"", False)

    def _send(self, data: bytes) -> None:
        self._connection.send(self._stream, b"", data, b"", False)

    def _close(
        self, code: grpc.StatusCode, details: str, status: int = 200, accept: bool = False
    ) -> None:
        """The call's status: in trailers after the response headers, else alone
        ("trailers-only", which carries the response headers too, with ``status``)."""
        if self._stream.closed:
            return
        block = OK_TRAILERS if code is grpc.StatusCode.OK else trailers(code, details, accept)
        if not self._headed:
            block = response_headers(status) + block
        tail = headers_frame(self._stream.id, block, True)
        self._connection.send(self._stream, b"", b"", tail, True)

    def _fail(
        self, code: grpc.StatusCode, details: str, status: int = 200, accept: bool = False
    ) -> None:
        self.cancel()
        self._close(code, details, status, accept)


def _unanswerable(response: Any) -> None:
    raise AssertionError("only a unary call answers through its context")
