"""The socket paho reads and writes through, under the bridge's
:class:`appliance.adapters.mqtt.link.LoopDriver`: paho reads only the packets the
driver hands it, and one flush sends what paho and the bridge wrote as one write."""

from __future__ import annotations

import contextlib
from typing import Any

from appliance.adapters.mqtt.packets import encode_varint

_CHUNK = 65536  # bytes asked of the kernel per read


class BufferedSocket:
    """A connected socket (plain or TLS) as paho uses it: paho reads only the packets
    :class:`LoopDriver` hands it, and the writes of one flush go out as one ``send``.

    Reads: the driver takes what the kernel holds (:meth:`read`, up to 64 KiB) and cuts
    it into packets; the ones paho handles (all but PUBLISH) are handed over whole
    (:meth:`hand`) and paho's small reads are served from them. Nothing handed: paho's
    ``recv`` says "would block", or, once the driver saw the stream end
    (:meth:`end`), what the socket said (b"" or the error), so paho closes it.
    :meth:`pending` counts what TLS has decrypted, which the selector cannot see.

    Writes: between :meth:`gather` and :meth:`flush`, ``send`` only collects (paho
    writes each packet on its own), as :meth:`queue` does for the bridge's own packets;
    :meth:`flush` sends them as one write, and what the kernel does not take yet stays,
    in order, ahead of any later ``send``. Closing sends what is left if the kernel
    takes it at once (a DISCONNECT written last).
    """

    __slots__ = ("_buf", "_ended", "_gathering", "_out", "_pos", "_sock", "_tls")

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = b""
        self._pos = 0
        self._ended: OSError | bool = False  # True: the peer closed; an error: it failed
        self._out: list[bytes] = []
        self._gathering = False
        self._tls = hasattr(sock, "pending")

    def read(self) -> bytes:
        """One read from the kernel (b"": the peer closed); raises as ``recv`` does."""
        data: bytes = self._sock.recv(_CHUNK)
        return data

    def hand(self, header: int, body: bytes) -> None:
        """A whole packet for paho to read (its first byte, its body after the length)."""
        packet = bytes((header,)) + encode_varint(len(body)) + body
        rest = self._buf[self._pos :]
        self._buf, self._pos = (rest + packet if rest else packet), 0

    def end(self, error: OSError | None) -> None:
        """The stream ended: paho reads it once what was handed is read."""
        self._ended = error if error is not None else True

    def recv(self, size: int) -> bytes:
        buf, pos = self._buf, self._pos
        if pos >= len(buf):
            ended = self._ended
            if isinstance(ended, OSError):
                raise ended
            if ended:
                return b""
            raise BlockingIOError  # nothing handed: as a non-blocking socket says
        end = min(pos + size, len(buf))
        self._pos = end
        if end >= len(buf):
            self._buf, self._pos = b"", 0
        return buf[pos:end]

    def pending(self) -> int:
        """Bytes TLS has decrypted and not given out yet (0 on a plain socket)."""
        held: int = self._sock.pending() if self._tls else 0
        return held

    def send(self, data: bytes | bytearray) -> int:
        if self._gathering or self._out:
            self._out.append(bytes(data))
            return len(data)
        sent: int = self._sock.send(data)
        return sent

    def queue(self, data: bytes) -> None:
        """A packet of the bridge's own, sent at the next :meth:`flush`."""
        self._out.append(data)

    def gather(self) -> None:
        self._gathering = True

    def flush(self) -> bool:
        """Send what was gathered; True while some of it waits for the kernel."""
        self._gathering = False
        if not self._out:
            return False
        data = self._out[0] if len(self._out) == 1 else b"".join(self._out)
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            # the connection is gone: paho sees it on its next read and closes it
            self._out.clear()
            return False
        self._out = [data[sent:]] if sent < len(data) else []
        return bool(self._out)

    @property
    def backlog(self) -> bool:
        return bool(self._out)

    def fileno(self) -> int:
        fd: int = self._sock.fileno()
        return fd

    def setblocking(self, flag: bool) -> None:
        self._sock.setblocking(flag)

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self._sock.setsockopt(level, option, value)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        if self._out:
            with contextlib.suppress(OSError):
                self._sock.send(b"".join(self._out))
            self._out.clear()
        self._sock.close()
