"""A trivial KServe-shaped HTTP server: the load generator's own ceiling.

``python -m appliance.perf.trivial PORT`` answers every ``POST`` with one canned
binary-extension reply and ``GET /v2/models/<m>`` (and ``/config``) with the
metadata of a ``simple``-like model (two INT32 [16] inputs), doing no work per
request beyond reading it. ``appliance perf --ceiling`` runs against it: what the
load generator reaches there is the most it can measure on this machine, so a
server measured well below that figure is not limited by the client.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import orjson

_METADATA = orjson.dumps(
    {
        "name": "trivial",
        "versions": ["1"],
        "platform": "trivial",
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]},
            {"name": "INPUT1", "datatype": "INT32", "shape": [-1, 16]},
        ],
        "outputs": [
            {"name": "OUTPUT0", "datatype": "INT32", "shape": [-1, 16]},
            {"name": "OUTPUT1", "datatype": "INT32", "shape": [-1, 16]},
        ],
    }
)
_CONFIG = orjson.dumps({"name": "trivial", "max_batch_size": 8})
_OUT_HEADER = orjson.dumps(
    {
        "model_name": "trivial",
        "outputs": [
            {
                "name": n,
                "datatype": "INT32",
                "shape": [1, 16],
                "parameters": {"binary_data_size": 64},
            }
            for n in ("OUTPUT0", "OUTPUT1")
        ],
    }
)


def _reply(status: str, body: bytes, extra: str = "") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


INFER = _reply(
    "200 OK",
    _OUT_HEADER + bytes(128),
    "Content-Type: application/octet-stream\r\n"
    f"Inference-Header-Content-Length: {len(_OUT_HEADER)}\r\n",
)
NOT_FOUND = _reply("404 Not Found", b'{"error":"not found"}')


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                key, _, value = line.partition(b":")
                if key.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            del self.buf[: end + 4 + length]
            self.transport.write(self._answer(head.split(b" ", 2)))

    @staticmethod
    def _answer(line: list[bytes]) -> bytes:
        method, path = line[0], line[1] if len(line) > 1 else b""
        if method == b"POST":
            return INFER
        if path.endswith(b"/config"):
            return _reply("200 OK", _CONFIG)
        if path.startswith(b"/v2/models/") and path.count(b"/") == 3:
            return _reply("200 OK", _METADATA)
        return NOT_FOUND


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Protocol, "127.0.0.1", port)
    print(server.sockets[0].getsockname()[1], flush=True)  # the port, for the parent
    await server.serve_forever()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
