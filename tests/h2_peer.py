"""A raw HTTP/2 client for the gRPC endpoint's hostile-peer tests
(tests/adapters/test_grpc_h2_hostile.py): frames built by hand (header blocks with
``hpack``), written on a plain loopback socket, and the server's frames read back and
decoded, so a test can send exactly the bytes an attacker would and see exactly what
the server answered (which frame, which error code).

Every read has a deadline (``timeout``): a server that does not answer fails the test
with ``socket.timeout`` instead of hanging it.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
SETTINGS_TIMEOUT, STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 4, 5, 6, 7, 8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 9, 11
MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_HEADER_LIST_SIZE = 3, 4, 6
INFER = "/inference.GRPCInferenceService/ModelInfer"
LIVE = "/inference.GRPCInferenceService/ServerLive"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", sid)
        + payload
    )


def settings(**values: int) -> bytes:
    """A SETTINGS frame; keys are the setting ids as ``s<id>`` (s4=0: window 0)."""
    payload = b"".join(struct.pack(">HI", int(k[1:]), v) for k, v in values.items())
    return frame(SETTINGS, 0, 0, payload)


def window_update(sid: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", increment))


def rst(sid: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, sid, struct.pack(">I", code))


def grpc_message(payload: bytes, flag: int = 0, length: int | None = None) -> bytes:
    """A length-prefixed gRPC message (``length`` overrides the prefix's length)."""
    return struct.pack(">BI", flag, len(payload) if length is None else length) + payload


def request_headers(path: str = LIVE, **extra: str | None) -> list[tuple[str, str]]:
    """A gRPC request's headers, as grpcio sends them; ``extra`` adds or replaces
    fields (underscores in a key become '-'; a value of None drops the field)."""
    fields: dict[str, str | None] = {
        ":method": "POST",
        ":scheme": "http",
        ":path": path,
        ":authority": "127.0.0.1",
        "te": "trailers",
        "content-type": "application/grpc",
    }
    for key, value in extra.items():
        fields[key.replace("_", "-")] = value
    return [(k, v) for k, v in fields.items() if v is not None]


@dataclass
class Frame:
    kind: int
    flags: int
    sid: int
    payload: bytes
    headers: dict[str, str] = field(default_factory=dict)  # a decoded HEADERS block

    @property
    def code(self) -> int:
        """The error code of a RST_STREAM or GOAWAY."""
        return struct.unpack(
            ">I", self.payload[-4:] if self.kind == RST_STREAM else self.payload[4:8]
        )[0]

    @property
    def last_stream(self) -> int:
        return struct.unpack(">I", self.payload[:4])[0] & 0x7FFFFFFF

    @property
    def debug(self) -> bytes:
        return self.payload[8:]


class Peer:
    """One raw HTTP/2 connection. With ``handshake`` (the default) it sends the preface
    and an empty SETTINGS, reads the server's SETTINGS (``server_settings``) and, with
    ``ack``, acknowledges them."""

    def __init__(
        self,
        url: str,
        handshake: bool = True,
        ack: bool = True,
        timeout: float = 30.0,
        receive_buffer: int = 0,
    ) -> None:
        host, port = url.rsplit(":", 1)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer:  # before connecting: the TCP window offered follows it
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.settimeout(timeout)
        self.sock.connect((host, int(port)))
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self._buffer = b""
        self.server_settings: dict[int, int] = {}
        self.eof = False
        if handshake:
            self.send(PREFACE + frame(SETTINGS, 0, 0))
            first = self.next()
            assert first is not None and first.kind == SETTINGS, first
            for i in range(0, len(first.payload), 6):
                key, value = struct.unpack(">HI", first.payload[i : i + 6])
                self.server_settings[key] = value
            if ack:
                self.send(frame(SETTINGS, ACK, 0))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, *chunks: bytes) -> bool:
        """Write the bytes; False once the server has closed the connection."""
        try:
            self.sock.sendall(b"".join(chunks))
            return True
        except OSError:  # reset or broken pipe: the server ended the connection
            return False

    def send_many(self, chunks: Iterable[bytes], batch: int = 256) -> bool:
        """Write a long run of frames in batches; False once the server closed."""
        pending: list[bytes] = []
        for chunk in chunks:
            pending.append(chunk)
            if len(pending) >= batch:
                if not self.send(*pending):
                    return False
                pending = []
        return self.send(*pending)

    def block(self, headers: list[tuple[str, str]]) -> bytes:
        return self.encoder.encode(headers)

    def headers(
        self,
        sid: int,
        headers: list[tuple[str, str]] | bytes,
        end_stream: bool = False,
        flags: int = END_HEADERS,
    ) -> bytes:
        block = headers if isinstance(headers, bytes) else self.block(headers)
        return frame(HEADERS, flags | (END_STREAM if end_stream else 0), sid, block)

    @staticmethod
    def data(sid: int, payload: bytes, end_stream: bool = True) -> bytes:
        """``payload`` as DATA frames of at most 16384 bytes (END_STREAM on the last)."""
        pieces = [payload[i : i + 16384] for i in range(0, len(payload), 16384)] or [b""]
        last = len(pieces) - 1
        return b"".join(
            frame(DATA, END_STREAM if end_stream and i == last else 0, sid, piece)
            for i, piece in enumerate(pieces)
        )

    def call(self, sid: int, path: str = LIVE, body: bytes = b"", **extra: str) -> bytes:
        """The frames of a whole unary call: HEADERS, then one DATA with END_STREAM."""
        head = self.headers(sid, request_headers(path, **extra))
        return head + self.data(sid, grpc_message(body))

    # ---- reading ----------------------------------------------------------------------

    def next(self) -> Frame | None:
        """The server's next frame; None at the end of the connection."""
        while len(self._buffer) < 9 or len(self._buffer) < 9 + int.from_bytes(
            self._buffer[:3], "big"
        ):
            try:
                chunk = self.sock.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.eof = True
                return None
            self._buffer += chunk
        length = int.from_bytes(self._buffer[:3], "big")
        kind, flags = self._buffer[3], self._buffer[4]
        sid = int.from_bytes(self._buffer[5:9], "big") & 0x7FFFFFFF
        payload, self._buffer = self._buffer[9 : 9 + length], self._buffer[9 + length :]
        got = Frame(kind, flags, sid, payload)
        if kind == HEADERS:
            got.headers = dict(self.decoder.decode(payload))
        return got

    def frames(self) -> Iterator[Frame]:
        while (got := self.next()) is not None:
            yield got

    def until(self, kind: int, sid: int | None = None) -> Frame:
        """Read up to the next frame of ``kind`` (on stream ``sid``); AssertionError
        when the connection ends first."""
        seen = []
        for got in self.frames():
            if got.kind == kind and (sid is None or got.sid == sid):
                return got
            seen.append((got.kind, got.sid))
        raise AssertionError(f"the connection ended before a frame of type {kind}: {seen[-20:]}")

    def goaway(self) -> Frame:
        """The server's GOAWAY, and the connection's end right after it."""
        got = self.until(GOAWAY)
        for _ in self.frames():  # read to the end: the server closes the connection
            pass
        return got

    def answer(self, sid: int) -> tuple[dict[str, str], list[bytes]]:
        """A stream's answer: its header fields (headers and trailers merged) and its
        DATA payloads; a RST_STREAM ends it as ``{"rst": code}``."""
        fields: dict[str, str] = {}
        data: list[bytes] = []
        for got in self.frames():
            if got.sid != sid:
                continue
            if got.kind == RST_STREAM:
                fields.setdefault("rst", str(got.code))
                return fields, data
            if got.kind == DATA:
                data.append(got.payload)
            if got.kind == HEADERS:
                fields.update(got.headers)
            if got.flags & END_STREAM:
                return fields, data
        raise AssertionError(f"the connection ended before stream {sid} did")
