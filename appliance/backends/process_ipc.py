"""The wire between the server and a model's worker process (process isolation).

Two channels per instance, both private to the pair (inherited file descriptors,
nothing named in the file system):

- control: a Unix stream socket carrying small JSON frames (a 4-byte little-endian
  length, then UTF-8 JSON): what to run and where its tensors lie. JSON, never
  pickle: the server must not unpickle what a process running user code sends it.
- tensors: one anonymous shared-memory file (``memfd``) mapped by both sides and
  reused across requests. The sender writes each tensor's bytes at an aligned
  offset and the frame names (name, datatype, shape, offset, nbytes). Fixed-size
  tensors are raw little-endian bytes; BYTES tensors use Triton's length-prefixed
  encoding. Either side may grow the file when a request or its outputs need more
  room; the frame carries the size so the other side remaps.

Everything read from the other side is validated here (bounds, datatypes, sizes):
the worker's answers are as untrusted as a client's request.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import socket
import struct
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from appliance import datatypes
from appliance.backends.base import BackendOptions, TensorSpec, engine_message
from appliance.errors import ApplianceError, Code, FailureReason, internal

ALIGN = 64  # every tensor starts on a cache line
MAX_FRAME = 16 * 2**20  # control frames carry metadata only
_HEADER = struct.Struct("<I")


class ChannelClosed(Exception):
    """The other side closed the control socket (it exited or died)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ---- control frames ---------------------------------------------------------------------


def send_frame(sock: socket.socket, message: Mapping[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int, on_idle: Callable[[], None]) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:  # the socket's timeout is the polling interval
            on_idle()
            continue
        except (ConnectionResetError, BrokenPipeError):
            raise ChannelClosed from None
        if k == 0:
            raise ChannelClosed
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, on_idle: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """The next frame; ``on_idle`` runs at each socket timeout while waiting (it may
    raise to give up). Raises :class:`ChannelClosed` at EOF, ``ValueError`` on a
    malformed frame."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, on_idle))
    if length > MAX_FRAME:
        raise ValueError(f"control frame of {length} bytes exceeds {MAX_FRAME}")
    message = json.loads(_recv_exact(sock, length, on_idle))
    if not isinstance(message, dict):
        raise ValueError("control frame is not a JSON object")
    return message


# ---- the shared tensor segment ----------------------------------------------------------


def create_segment_fd(size: int) -> int:
    """An anonymous shared-memory file of ``size`` bytes (memfd, or an unlinked file in
    /dev/shm where memfd is missing); freed once both processes closed it."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("appliance-tensors", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        # neither side can shrink it, so a mapping never reaches past its end (SIGBUS):
        # a worker running broken or hostile code cannot crash the server this way
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        return fd
    # no memfd (not Linux): an unlinked file, which cannot be sealed
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryFile(dir=folder) as f:
        fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    return fd


class Segment:
    """One side's mapping of the shared tensor file; never shrinks under a live view."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = 0
        self.map: mmap.mmap | None = None
        self.remap(size)

    def remap(self, size: int) -> None:
        """Map the file's first ``size`` bytes (after the other side resized it)."""
        if size == self.size and self.map is not None:
            return
        old, self.map, self.size = self.map, mmap.mmap(self.fd, size), size
        if old is not None:
            # a tensor may still view it: then it is freed with that tensor
            with contextlib.suppress(BufferError):
                old.close()

    def resize(self, size: int) -> None:
        """Set the file to ``size`` bytes and map it (the other side remaps on the next frame)."""
        os.ftruncate(self.fd, size)
        self.remap(size)

    def ensure(self, needed: int) -> None:
        """Grow (doubling, page-rounded) until ``needed`` bytes fit; the file may
        already be larger (the other side grew it): then only remap."""
        if needed <= self.size:
            return
        actual = os.fstat(self.fd).st_size
        if needed <= actual:
            self.remap(actual)
            return
        size = max(needed, 2 * actual)
        self.resize((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE)

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):
                self.map.close()
            self.map = None
        os.close(self.fd)


def _wire_form(arr: np.ndarray) -> tuple[str, np.ndarray | bytes]:
    """(datatype, what to copy): a little-endian array, or BYTES' serialized form."""
    datatype = datatypes.from_numpy_dtype(arr.dtype)
    if datatype == "BYTES":
        return datatype, datatypes.serialize_bytes(arr)
    return datatype, arr


def write_tensors(segment: Segment, tensors: Mapping[str, np.ndarray], start: int) -> list[Any]:
    """Copy ``tensors`` into ``segment`` from offset ``start`` (growing it as needed);
    returns their descriptors for the control frame."""
    forms = {name: _wire_form(arr) for name, arr in tensors.items()}
    offset = _aligned(start)
    layout = []
    for name, (datatype, data) in forms.items():
        nbytes = len(data) if isinstance(data, bytes) else data.nbytes
        layout.append((name, datatype, offset, nbytes))
        offset = _aligned(offset + nbytes)
    segment.ensure(offset)
    assert segment.map is not None
    descriptors = []
    for name, datatype, offset, nbytes in layout:
        data = forms[name][1]
        shape = list(tensors[name].shape)
        if isinstance(data, bytes):
            segment.map[offset : offset + nbytes] = data
        elif nbytes:
            dtype = data.dtype.newbyteorder("<")
            np.copyto(np.ndarray(data.shape, dtype, segment.map, offset), data, casting="equiv")
        descriptors.append([name, datatype, shape, offset, nbytes])
    return descriptors


def _descriptor(raw: Any, size: int) -> tuple[str, str, list[int], int, int]:
    """Validate one (name, datatype, shape, offset, nbytes) from the other side."""
    if not isinstance(raw, list) or len(raw) != 5:
        raise ValueError(f"bad tensor descriptor {raw!r}")
    name, datatype, shape, offset, nbytes = raw
    ints = [*shape, offset, nbytes] if isinstance(shape, list) else []
    if (
        not isinstance(name, str)
        or datatype not in datatypes.DATATYPES
        or not isinstance(shape, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in ints)
        or len(shape) > 64
    ):
        raise ValueError(f"bad tensor descriptor {raw!r}")
    if offset + nbytes > size:
        raise ValueError(f"tensor '{name}' lies outside the shared segment ({size} bytes)")
    fixed = datatypes.byte_size(datatype, shape)
    if fixed is not None and fixed != nbytes:
        raise ValueError(f"tensor '{name}': {nbytes} bytes for {datatype} {shape}")
    return name, datatype, shape, offset, nbytes


def read_tensors(segment: Segment, raw: Any, copy: bool) -> dict[str, np.ndarray]:
    """The tensors ``raw`` describes: copies (``copy``, for the server, which reuses the
    segment for its next request) or read-only views (for the worker, valid until its
    next request)."""
    if not isinstance(raw, list):
        raise ValueError("tensor descriptors must be a list")
    assert segment.map is not None
    out: dict[str, np.ndarray] = {}
    for item in raw:
        name, datatype, shape, offset, nbytes = _descriptor(item, segment.size)
        if datatype == "BYTES":
            with memoryview(segment.map) as view:
                out[name] = datatypes.deserialize_bytes(view[offset : offset + nbytes], shape, name)
            continue
        dtype = datatypes.to_numpy_dtype(datatype).newbyteorder("<")
        if nbytes == 0:
            out[name] = np.empty(shape, dtype)
            continue
        arr = np.frombuffer(segment.map, dtype, nbytes // dtype.itemsize, offset).reshape(shape)
        if copy:
            arr = arr.copy()
        else:
            arr.flags.writeable = False
        out[name] = arr
    return out


# ---- what else crosses: backend options, tensor specs, errors ------------------------


def specs_to_wire(specs: Iterable[TensorSpec]) -> list[Any]:
    return [[s.name, s.datatype, list(s.shape)] for s in specs]


def specs_from_wire(raw: Any) -> list[TensorSpec]:
    """Tensor specs from the other side; ``ValueError`` when malformed."""
    if not isinstance(raw, list) or not all(isinstance(s, list) and len(s) == 3 for s in raw):
        raise ValueError(f"bad tensor specs {raw!r}"[:200])
    try:
        return [TensorSpec(str(n), str(d), tuple(int(x) for x in shape)) for n, d, shape in raw]
    except TypeError:
        raise ValueError(f"bad tensor specs {raw!r}"[:200]) from None


# the BackendOptions a worker receives: plain values only (a field holding an object of
# the server, such as a callback, never crosses; the worker gets its default)
_OPTION_FIELDS = (
    "instance_index",
    "instance_count",
    "kind",
    "threads",
    "max_batch_size",
    "share_group",
    "model_config",
    "config_source",
)


def options_to_wire(options: BackendOptions, drop: Collection[str]) -> dict[str, Any]:
    """``options`` as JSON values, without the parameters named in ``drop``."""
    out: dict[str, Any] = {name: getattr(options, name) for name in _OPTION_FIELDS}
    out["model_path"] = str(options.model_path.absolute())  # the worker runs elsewhere
    out["key_file"] = str(options.key_file.absolute()) if options.key_file else ""
    out["parameters"] = {k: v for k, v in options.parameters.items() if k not in drop}
    out["inputs"] = specs_to_wire(options.inputs)
    out["outputs"] = specs_to_wire(options.outputs)
    return out


def options_from_wire(raw: dict[str, Any]) -> BackendOptions:
    """The worker's side of :func:`options_to_wire` (the server is trusted)."""
    return BackendOptions(
        model_path=Path(raw["model_path"]),
        key_file=Path(raw["key_file"]) if raw.get("key_file") else None,
        parameters=dict(raw["parameters"]),
        inputs=tuple(specs_from_wire(raw["inputs"])),
        outputs=tuple(specs_from_wire(raw["outputs"])),
        **{name: raw[name] for name in _OPTION_FIELDS},
    )


def error_frame(exc: BaseException) -> dict[str, Any]:
    """How the worker reports an exception: code, failure reason and message."""
    error = exc if isinstance(exc, ApplianceError) else internal(f"{type(exc).__name__}: {exc}")
    return {
        "ok": False,
        "code": error.code.value,
        "reason": error.reason.value,
        "message": error.message,
    }


def error_from_frame(reply: dict[str, Any]) -> ApplianceError:
    """The error a worker reported, as the server's own (codes checked, not trusted)."""
    codes = {c.value: c for c in Code}
    reasons = {r.value: r for r in FailureReason}
    return ApplianceError(
        codes.get(str(reply.get("code")), Code.INTERNAL),
        engine_message(str(reply.get("message", "no message"))),
        reasons.get(str(reply.get("reason")), FailureReason.BACKEND),
    )
