"""A lean HTTP/1.1 client for the load generator, and KServe v2 binary request bodies.

The load generator must not be the bottleneck on a 2-core device, so requests are
prebuilt byte strings (request line, headers and body in one ``write``) sent over
keep-alive connections with asyncio streams; a response is read as status line,
headers and a ``Content-Length`` (or chunked) body, nothing more. One connection
per outstanding request, as perf_analyzer does.

:class:`Admin` is the control channel used around a run (metadata, config,
statistics, repository load, shared-memory registration), over the same client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import numpy as np
import orjson

from appliance.datatypes import from_numpy_dtype, to_raw
from appliance.errors import ApplianceError, Code, invalid

HEADER_LENGTH = "Inference-Header-Content-Length"


class RequestFailed(Exception):
    """A request the server refused or that failed on the way; ``kind`` groups errors."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def split_url(url: str, default_port: int) -> tuple[str, int]:
    """``host:port`` (an ``http://`` prefix and a trailing slash are accepted)."""
    rest = url.removeprefix("http://").rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep:
        return rest or "127.0.0.1", default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise invalid(f"URL {url!r}: expected host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


def model_path(model: str, version: str = "") -> str:
    """``/v2/models/<m>[/versions/<v>]`` with both names percent-encoded."""
    path = "/v2/models/" + quote(model, safe="")
    return path + (f"/versions/{quote(version, safe='')}" if version else "")


def error_kind(prefix: str, body: bytes) -> str:
    """A short, stable label for an error reply: its message, cut to 100 characters."""
    try:
        doc = orjson.loads(body)
        message = str(doc.get("error", "")) if isinstance(doc, dict) else ""
    except orjson.JSONDecodeError:
        message = body[:100].decode("utf-8", "replace")
    return f"{prefix}: {message[:100]}" if message else prefix


class Connection:
    """One keep-alive HTTP/1.1 connection; reconnects after a failure."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(
                self.host, self.port, limit=1 << 20
            )
        return self._reader, self._writer

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        """Send one prebuilt request; returns (status, body). Connection trouble is a
        :class:`RequestFailed` of kind ``connection: <error>``."""
        try:
            reader, writer = await self._open()
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length, chunked, close = _headers(head)
            if chunked:
                body = await _read_chunked(reader)
            else:
                body = await reader.readexactly(length) if length else b""
            if close:
                await self.close()
            return status, body
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            await self.close()
            raise RequestFailed(f"connection: {type(exc).__name__}") from None

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def _headers(head: bytes) -> tuple[int, bool, bool]:
    length, chunked, close = 0, False, False
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        key = key.strip().lower()
        if key == b"content-length":
            length = int(value)
        elif key == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif key == b"connection":
            close = b"close" in value.lower()
    return length, chunked, close


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


def build_request(
    method: str, path: str, host: str, body: bytes = b"", headers: Mapping[str, str] = {}
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def binary_body(
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str] = (),
    shm_inputs: Mapping[str, tuple[str, int, int]] = {},
    shm_outputs: Mapping[str, tuple[str, int, int]] = {},
) -> tuple[bytes, int]:
    """A KServe v2 request with Triton's binary extension: (body, JSON header length).

    Inputs named in ``shm_inputs`` (region, offset, size) are referenced, not sent;
    outputs come back binary, or into ``shm_outputs``.
    """
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, arr in inputs.items():
        entry: dict[str, Any] = {
            "name": name,
            "shape": list(arr.shape),
            "datatype": from_numpy_dtype(arr.dtype),
        }
        if name in shm_inputs:
            region, offset, size = shm_inputs[name]
            entry["parameters"] = {
                "shared_memory_region": region,
                "shared_memory_offset": offset,
                "shared_memory_byte_size": size,
            }
        else:
            raw = bytes(to_raw(arr))
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        tensors.append(entry)
    doc: dict[str, Any] = {"inputs": tensors}
    wanted = list(outputs) or list(shm_outputs)
    if wanted:
        outs = []
        for name in wanted:
            if name in shm_outputs:
                region, offset, size = shm_outputs[name]
                params: dict[str, Any] = {
                    "shared_memory_region": region,
                    "shared_memory_offset": offset,
                    "shared_memory_byte_size": size,
                }
            else:
                params = {"binary_data": True}
            outs.append({"name": name, "parameters": params})
        doc["outputs"] = outs
    else:
        doc["parameters"] = {"binary_data_output": True}
    header = orjson.dumps(doc)
    return header + b"".join(blobs), len(header)


class Admin:
    """Control calls around a run, over HTTP: metadata, config, stats, load, shm."""

    def __init__(self, url: str, token: str = "") -> None:
        self.host, self.port = split_url(url, 8000)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._conn = Connection(self.host, self.port)
        self._lock = asyncio.Lock()

    async def call(self, method: str, path: str, doc: Any = None) -> tuple[int, bytes]:
        body = orjson.dumps(doc) if doc is not None else b""
        headers = dict(self._headers)
        if doc is not None:
            headers["Content-Type"] = "application/json"
        raw = build_request(method, path, f"{self.host}:{self.port}", body, headers)
        async with self._lock:
            try:
                return await self._conn.send(raw)
            except RequestFailed as exc:
                raise ApplianceError(
                    Code.UNAVAILABLE, f"server at {self.host}:{self.port}: {exc.kind}"
                ) from None

    async def get_json(self, path: str) -> Any:
        status, body = await self.call("GET", path)
        if status != 200:
            raise ApplianceError(
                Code.NOT_FOUND if status == 404 else Code.UNAVAILABLE,
                error_kind(f"GET {path}: HTTP {status}", body),
            )
        return orjson.loads(body) if body else None

    async def post(self, path: str, doc: Any = None) -> None:
        status, body = await self.call("POST", path, {} if doc is None else doc)
        if status != 200:
            raise ApplianceError(Code.INVALID_ARG, error_kind(f"POST {path}: HTTP {status}", body))

    async def stats(self, model: str) -> dict[str, Any] | None:
        """The model's statistics (the first version listed), None if not offered."""
        status, body = await self.call("GET", model_path(model) + "/stats")
        if status != 200:
            return None
        rows = orjson.loads(body).get("model_stats") or []
        return rows[-1] if rows else None

    async def close(self) -> None:
        await self._conn.close()
