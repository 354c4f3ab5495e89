"""The HTTP/1.1 front (:mod:`appliance.adapters.http.listener` puts it on the socket).
aiohttp's request handling cost an eighth of the server's CPU on the inference path
(docs/benchmarks.md), so this front reads each head itself (strictly:
:mod:`appliance.adapters.http.head`). An inference is checked for its token and admitted
before its body is read, then answered through :mod:`appliance.adapters.http.infer` (as
the aiohttp route is); a read-only route (:mod:`appliance.adapters.http.reads`) at once.
The first other request (another route, ``Expect: 100-continue``, a chunked body...)
hands the connection, from its first byte, to aiohttp for good
(:mod:`appliance.adapters.http.handover`), or is refused 404 where nothing is behind the
front (the metrics endpoint).

What a peer may take is the same on both sides (:mod:`appliance.adapters.http.limits`):
a declared body over ``max_request_size`` is answered 413 before it is read; a head
must be complete within ``http_header_timeout_s`` of the connection opening or of the
previous answer (an idle keep-alive connection is closed then); a body must arrive
within ``http_body_timeout_s`` (else 408); a connection answered 413/408 drops what
the client still sends for a while (lingering) before it closes; one handed over
mid-head gets aiohttp's timer from then on. A request refused before its body (a token,
an unknown model, a full queue) is answered at once and its body dropped as it arrives.
While one request is served, the next is buffered but not started (HTTP/1.1 answers
in order); reading pauses while more than :data:`PAUSE_BYTES` wait, and a new request
waits, unread, while the transport's write buffer is full (a client that sends
requests without reading its answers makes the server hold no more of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import cast

from appliance.adapters.access import AccessPolicy, Scope
from appliance.adapters.codec import kserve
from appliance.adapters.http import head as http_head
from appliance.adapters.http import infer as http_infer
from appliance.adapters.http import reads
from appliance.adapters.http.backstage import Backstage
from appliance.adapters.http.deadline import Deadline
from appliance.adapters.http.handover import hand_over
from appliance.core.admission import Ticket
from appliance.core.dataplane import DataPlane
from appliance.errors import ApplianceError

log = logging.getLogger(__name__)

PAUSE_BYTES = 1 << 20  # buffered bytes of later requests before reading pauses
_MAX_LINGER_S = 10.0  # aiohttp's lingering default
_JOIN_BYTES = 64 * 1024  # answers up to this size are copied into one buffer
_DIRECT_BYTES = 64 * 1024  # bodies above this size are received into their own buffer


class Front:
    """What every connection of one listener shares."""

    def __init__(
        self,
        dataplane: DataPlane,
        access: AccessPolicy,
        backstage: Backstage | None,
        max_request_size: int,
        header_timeout_s: float,
        body_timeout_s: float,
        routes: reads.Routes,
        infer: bool = True,
    ) -> None:
        self.dataplane = dataplane
        self.access = access
        self.backstage = backstage
        self.routes = routes
        self.infer = infer  # inference is served (not on the metrics endpoint)
        self.max_request_size = max_request_size
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.linger_s = min(_MAX_LINGER_S, body_timeout_s)
        self.connections: set[Connection] = set()

    def serves(self, route: str) -> bool:
        return self.infer if route == http_head.INFER else route in self.routes

    def protocol(self) -> Connection:
        return Connection(self)


class Connection(asyncio.Protocol):
    """One client connection until it is closed or handed to aiohttp."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()  # received, not yet taken by a request
        self.head: http_head.Head | None = None  # parsed, its body still arriving
        self.head_size = 0
        self.busy = False  # a request is being answered
        self.answering: asyncio.Task[None] | None = None  # ... by this task
        self.lingering = False  # answered 413/408: dropping the rest, then closing
        self.write_paused = False
        self.read_paused = False
        self.deadline = Deadline(self.loop)  # the head's, the body's or lingering's
        self.scanned = 0  # buffer bytes already searched for the end of a head
        self.ticket: Ticket | None = None  # the admission of the request in ``head``
        self.skip = 0  # body bytes of a request answered early, still to drop
        self.early = False  # a request was just answered early: the next may follow
        self.keep_alive = True  # the request being served asked to keep the connection
        self.eof = False  # the client closed its side
        self.body: bytearray | None = None  # a big body being received, and how far
        self.filled = 0

    # ---- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.front.connections.add(self)
        self.deadline.arm(self.front.header_timeout_s, self._head_late)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        if self.body is not None:  # a big body: straight into its own buffer
            room = len(self.body) - self.filled
            taken = min(room, len(data))
            self.body[self.filled : self.filled + taken] = memoryview(data)[:taken]
            self.filled += taken
            if taken < len(data):
                self.buffer += memoryview(data)[taken:]
        else:
            self.buffer += data
        if not self.busy:
            self._advance()
        # nothing more is read while a request is served and more waits behind it, or
        # while the client does not read its answers (pipelined requests it sends are
        # not taken into memory until it does)
        backed_up = self.write_paused or (self.busy and len(self.buffer) > PAUSE_BYTES)
        if backed_up and not self.read_paused:
            self.read_paused = True
            self._transport().pause_reading()

    def eof_received(self) -> bool | None:
        self.eof = True
        if not self.busy:
            self.close()  # nothing to answer, or a body that can no longer complete
            return False
        return True  # half-closed: the request being answered still gets its answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadline.stop()
        self.front.connections.discard(self)
        if self.head is not None:
            log.debug("client left in the middle of a request body: %s", exc)
        self._drop_request()
        self.transport = None
        if self.answering is not None and not self.answering.done():
            # the answer has nowhere to go: a request still queued leaves its model's
            # queue (the batcher withdraws a cancelled request no instance took yet)
            self.answering.cancel()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if not self.busy:
            if self.read_paused and self.transport is not None:
                self.read_paused = False
                self.transport.resume_reading()
            self._advance()

    # ---- requests --------------------------------------------------------------------

    def _advance(self) -> None:
        """Take what has arrived: drop a refused request's body, start the next
        request whose head and body are here, or hand the connection over; requests
        answered early (refused from their heads) one after the other, in a loop."""
        while self._next():
            pass

    def _next(self) -> bool:
        """One step of :meth:`_advance`; True when a request was answered early and
        the next one may follow at once."""
        if self.transport is None or self.write_paused:
            return False
        if self.skip:
            dropped = min(self.skip, len(self.buffer))
            del self.buffer[:dropped]
            self.skip -= dropped
            if self.skip:
                return False
            self.deadline.arm(self.front.header_timeout_s, self._head_late)
        if self.head is None and not self._take_head():
            again, self.early = self.early, False
            return again
        head = self.head
        assert head is not None
        body: bytes | bytearray
        if self.body is not None:
            if self.filled < len(self.body):
                return False  # the body is still arriving
            body, self.body = self.body, None
        else:
            size = self.head_size + head.content_length
            if len(self.buffer) < size:
                return False  # the body is still arriving
            body = bytes(memoryview(self.buffer)[self.head_size : size])
            del self.buffer[:size]
        self.deadline.disarm()
        ticket, self.head, self.ticket = self.ticket, None, None
        assert ticket is not None
        self.busy, self.keep_alive = True, head.keep_alive
        self.answering = self.loop.create_task(self._answer(head, ticket, body))
        return False

    def _take_head(self) -> bool:
        """Parse the next head and admit its request; False when it is not complete,
        was answered at once, or the connection went to aiohttp."""
        end = self.buffer.find(b"\r\n\r\n", max(0, self.scanned - 3), http_head.MAX_HEAD)
        if end < 0:
            self.scanned = len(self.buffer)
            if len(self.buffer) >= http_head.MAX_HEAD:
                self._hand_over()
            return False
        self.scanned = 0
        head = http_head.parse(bytes(memoryview(self.buffer)[: end + 4]))
        front = self.front
        if head is None or not front.serves(head.route):
            self._hand_over()
            return False
        if head.route != http_head.INFER:
            self._read(head, end + 4)
            return False
        if head.content_length > front.max_request_size:
            self._refuse(
                413,
                f"request body of {head.content_length} bytes (Content-Length) exceeds the "
                f"server's limit of {front.max_request_size} bytes (max_request_size)",
            )
            return False
        # who may call, and one admission, before the body is taken into memory
        denial = front.access.check_all(Scope.INFERENCE, head.authorizations)
        try:
            if denial is None:
                self.ticket = front.dataplane.admit(head.model, head.version, head.content_length)
        except ApplianceError as exc:
            self._early(head, end + 4, http_infer.STATUS[exc.code], exc.message)
            return False
        if denial is not None:
            self._early(head, end + 4, 403 if denial.forbidden else 401, denial.message)
            return False
        self.head, self.head_size = head, end + 4
        if head.content_length > _DIRECT_BYTES:
            # a big body gets a buffer of its size, each received chunk copied once
            # (collected in ``buffer`` and cut out, 64 MiB would be copied again in
            # one piece on the event loop)
            self.body = bytearray(head.content_length)
            here = memoryview(self.buffer)[end + 4 : end + 4 + head.content_length]
            self.filled = len(here)
            self.body[: self.filled] = here
            here.release()
            del self.buffer[: end + 4 + self.filled]
            self.head_size = 0
        self.deadline.arm(front.body_timeout_s, self._body_late)
        return True

    def _read(self, head: http_head.Head, head_size: int) -> None:
        """A read-only route, answered at once (no body: the next request may follow)."""
        front = self.front
        status, body, content_type = reads.respond(front.routes, front.access, head)
        del self.buffer[:head_size]
        keep = head.keep_alive and front.dataplane.accepting
        self._write(status, [body], None, keep, content_type)
        if not keep:
            self.close()  # (what was written still goes out)
            return
        self.deadline.arm(front.header_timeout_s, self._head_late)
        self.early = True  # _advance goes on with what follows

    def _early(self, head: http_head.Head, head_size: int, status: int, message: str) -> None:
        """Answer before the body is read; the body is then dropped as it arrives (for
        at most the lingering time), and the connection stays open for the next one."""
        del self.buffer[:head_size]
        keep = head.keep_alive and self.front.dataplane.accepting
        self._write(status, [kserve.error_body(message)], None, keep)
        if not keep:
            self._linger()
            return
        self.skip = head.content_length
        if self.skip:
            self.deadline.arm(self.front.linger_s, self.close)
        else:
            self.deadline.arm(self.front.header_timeout_s, self._head_late)
        self.early = True  # _advance goes on with what follows (a loop, not a recursion)

    async def _answer(self, head: http_head.Head, ticket: Ticket, body: bytes | bytearray) -> None:
        """The request through the one exchange, which releases its ticket after
        :meth:`_answered` wrote the answer (or on a failure, answered here); then the
        next request, which is admitted only now."""
        front = self.front
        parts: list[bytes | memoryview]
        try:
            await http_infer.answer(
                front.dataplane,
                ticket,
                head.model,
                head.version,
                body,
                head.header_length,
                self._answered,
                head.headers(),
            )
        except ApplianceError as exc:
            status, parts = http_infer.STATUS[exc.code], [kserve.error_body(exc.message)]
            self._answered((parts, None), status)
        except Exception as exc:  # a bug: answer 500 and keep serving
            log.exception("unhandled error on POST /v2/models/%s/infer", head.model)
            status, parts = 500, [kserve.error_body(f"internal error: {exc}")]
            self._answered((parts, None), status)
        self._after_answer()

    def _answered(self, answer: http_infer.Answer, status: int = 200) -> None:
        """Write the answer of the request being served (once)."""
        if not self.busy:
            return
        parts, length = answer
        self.busy = False
        self.keep_alive = self.keep_alive and self.front.dataplane.accepting and not self.eof
        if self.transport is not None:  # (else the client left: nowhere to go)
            self._write(status, parts, length, self.keep_alive)

    def _after_answer(self) -> None:
        """Close, or go on with the next request (its hold taken after this one's was
        given back)."""
        if self.transport is None:
            return
        if not self.keep_alive:
            self.close()
            return
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        self.deadline.arm(self.front.header_timeout_s, self._head_late)
        if self.buffer:
            self._advance()

    def _write(
        self,
        status: int,
        parts: list[bytes | memoryview],
        length: int | None,
        keep: bool,
        content_type: bytes = b"application/json",
    ) -> None:
        """One answer: its head and body parts in one write (joined when small: one
        ``write`` goes out at once, ``writelines`` waits for the loop's turn)."""
        size = sum(map(len, parts))
        head = http_head.answer(status, size, length, keep, content_type)
        if size <= _JOIN_BYTES:
            self._transport().write(b"".join([head, *parts]))
        else:
            self._transport().writelines([head, *parts])

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` and close after lingering (the client may still be sending
        the body it announced; closing at once could reset the answer away)."""
        self._drop_request()
        self._write(status, [kserve.error_body(message)], None, keep=False)
        self._linger()

    def _linger(self) -> None:
        """After a last answer: drop what the client still sends, close when it has
        closed its side or after the lingering time."""
        self.lingering = True
        self.buffer.clear()
        transport = self._transport()
        if transport.can_write_eof():
            transport.write_eof()
        self.deadline.arm(self.front.linger_s, self.close)

    def _drop_request(self) -> None:
        """Forget the request whose body was awaited, and its admission."""
        self.head = self.body = None
        if self.ticket is not None:
            self.ticket.release()
            self.ticket = None

    # ---- what is late, and the hand-over ---------------------------------------------

    def _head_late(self) -> None:
        """No complete head within the header timeout: closed without an answer, as
        aiohttp's keep-alive timer does."""
        if not self.busy:
            self.close()

    def _body_late(self) -> None:
        if self.head is None:
            return
        log.debug("body not complete in %.1fs", self.front.body_timeout_s)
        self._refuse(
            408,
            f"the request body did not arrive within {self.front.body_timeout_s:g}s "
            f"(http_body_timeout_s)",
        )

    def _hand_over(self) -> None:
        """aiohttp serves this connection from the first byte of the current request on
        (:mod:`appliance.adapters.http.handover`); with nothing behind this front, the
        request is refused (404) and the connection closed."""
        self.deadline.stop()
        self._drop_request()
        backstage = self.front.backstage
        if backstage is None:
            self._refuse(404, "not found: this endpoint serves GET /metrics only")
            return
        self.front.connections.discard(self)
        transport = self._transport()
        self.transport = None
        self.read_paused = False  # (paused only while busy or not written to: never here)
        data, self.buffer = bytes(self.buffer), bytearray()
        hand_over(transport, backstage, data)

    @property
    def idle(self) -> bool:
        """Waiting for a request, nothing of one received (shutdown closes these)."""
        if self.busy or self.head or self.buffer or self.skip or self.transport is None:
            return False
        return not self.transport.is_closing()

    def close(self) -> None:
        self.deadline.stop()
        self._drop_request()
        if self.transport is not None:
            self.transport.close()

    def _transport(self) -> asyncio.Transport:
        assert self.transport is not None
        return self.transport
