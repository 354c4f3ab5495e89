"""Triton's system shared-memory extension: registered POSIX shm regions.

A camera process writes a frame into a POSIX shared-memory object, registers it
once (name, key, offset, byte_size), and then sends requests that point at the
region instead of carrying the bytes. Inputs are read as zero-copy views of the
mapping; outputs are written straight into it.

Safety: off unless the server config enables it (Triton asks for the same
opt-in); every access is bounds-checked against the registered window, so a
request can never read or write outside it. Unregistering a region that
in-flight requests use lets them finish, as in Triton: a request holds each region
it names from its declaration to its answer (:meth:`SharedMemoryRegistry.hold`), and
a region unregistered while held stays registered (and usable) until the last hold
ends. The registry never calls ``mmap.close()`` (which raises BufferError while
views exist); the mapping is unmapped when the last view is released (numpy arrays
keep the mmap alive through their buffer). Errors carry Triton's texts, our detail
after them.

Not defended against: a client that shrinks (ftruncate) the object after
registering it; touching the lost pages raises SIGBUS, as it does in Triton.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError, Code, internal, invalid, not_found

SHM_DIR = Path("/dev/shm")  # where Linux exposes POSIX shared-memory objects
# as glibc's shm_open: never follow a symlink planted in the world-writable /dev/shm
_OPEN_FLAGS = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# keys Triton keeps for the shm regions its Python backend creates
RESERVED_PREFIX = "triton_python_backend_shm_region_"


@dataclass(frozen=True, slots=True)
class SharedMemoryRef:
    """A tensor's place in a registered region, as a request's parameters give it."""

    region: str
    offset: int
    byte_size: int


@dataclass(slots=True)
class Region:
    """One registered window: ``byte_size`` bytes at ``offset`` of the object ``key``.

    ``mapping`` starts at the page boundary at or below ``offset``; the window starts
    ``base`` bytes into it.
    """

    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap
    base: int
    holds: int = 0  # requests using it now
    retired: bool = False  # unregistered while held: dropped when the last hold ends

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _key_path(name: str, key: str) -> Path:
    """/dev/shm path of a POSIX shm name, validated as glibc's shm_open does and as
    Triton refuses keys (all slashes, its reserved prefix)."""
    bare = key.lstrip("/")
    if not bare:
        raise invalid(f"cannot register shared memory region '{name}' - invalid shm key '{key}'")
    if bare.startswith(RESERVED_PREFIX):
        raise invalid(
            f"cannot register shared memory region '{name}' with key '{key}' as the key "
            f"contains the reserved prefix '{RESERVED_PREFIX}'"
        )
    if "/" in bare or "\0" in bare or bare in (".", ".."):
        raise invalid(f"shared-memory key {key!r} is not a POSIX shared-memory name")
    return SHM_DIR / bare


class SharedMemoryRegistry:
    """Registered regions by name.

    Methods may run on the event loop or on worker threads (HTTP decodes large
    bodies off the loop); a lock guards the map. A region handed out by
    :meth:`view` stays valid after :meth:`unregister`: the view owns the mapping.
    Every failure is an :class:`ApplianceError` (INVALID_ARG, or NOT_FOUND for an
    unknown name in :meth:`status`).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise ApplianceError(
                Code.INVALID_ARG,
                "system shared memory is disabled on this "
                "server; set 'shared_memory: system' in the server config",
            )

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes at ``offset`` of the POSIX shm object ``key``."""
        self._check_enabled()
        if not isinstance(name, str) or not name:
            raise invalid("a shared-memory region needs a non-empty name")
        if not isinstance(key, str):
            raise invalid(f"shared-memory region '{name}': 'key' must be a string")
        if not _is_size(offset) or not _is_size(byte_size) or byte_size == 0:
            raise invalid(
                f"shared-memory region '{name}': offset must be an integer >= 0 and "
                f"byte_size an integer > 0, got offset {offset!r}, byte_size {byte_size!r}"
            )
        path = _key_path(name, key)
        with self._lock:
            if name in self._regions:
                raise invalid(f"shared memory region '{name}' already in manager")
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            raise internal(
                f"Unable to open shared memory region: '{key}' ({exc.strerror})"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise invalid(f"shared-memory key {key!r} is not a shared-memory object")
            if offset + byte_size > info.st_size:
                raise invalid(
                    f"failed to register shared memory region '{name}': invalid args "
                    f"(offset {offset} + byte_size {byte_size} exceeds the {info.st_size} "
                    f"bytes of key {key!r})"
                )
            base = offset % mmap.ALLOCATIONGRANULARITY  # mmap offsets must be page-aligned
            try:
                mapping = mmap.mmap(fd, base + byte_size, offset=offset - base)
            except (OSError, ValueError) as exc:
                raise invalid(f"cannot map shared-memory key {key!r}: {exc}") from None
        finally:
            os.close(fd)
        with self._lock:
            if name in self._regions:  # another thread registered it while we mapped
                raise invalid(f"shared memory region '{name}' already in manager")
            self._regions[name] = Region(name, key, offset, byte_size, mapping, base)

    def unregister(self, name: str = "") -> None:
        """Forget one region (or all with ``name == ""``); an unknown name is a no-op,
        as in Triton. A region requests hold stays until the last of them is answered
        (:meth:`hold`). The mapping stays valid for arrays that still view it and is
        unmapped with the last of them (never closed here: see the module doc)."""
        self._check_enabled()
        with self._lock:
            names = [name] if name else list(self._regions)
            for each in names:
                region = self._regions.get(each)
                if region is None:
                    continue
                if region.holds:
                    region.retired = True
                else:
                    del self._regions[each]

    def hold(self, name: str, what: str) -> Region:
        """Keep region ``name`` registered until :meth:`release`, for a request that
        uses it (unregistering it meanwhile takes effect then); INVALID_ARG when it
        is not registered."""
        self._check_enabled()
        with self._lock:
            region = self._regions.get(name)
            if region is None:
                raise _unknown(name, what)
            region.holds += 1
            return region

    def release(self, region: Region) -> None:
        """End one :meth:`hold`; the last hold of an unregistered region drops it."""
        with self._lock:
            region.holds -= 1
            if region.holds == 0 and region.retired and self._regions.get(region.name) is region:
                del self._regions[region.name]

    def status(self, name: str = "") -> list[dict[str, Any]]:
        """Triton's status list: ``[{name, key, offset, byte_size}]``."""
        self._check_enabled()
        with self._lock:
            if name:
                region = self._regions.get(name)
                if region is None:
                    raise not_found(f"Unable to find system shared memory region: '{name}'")
                return [region.status()]
            return [r.status() for r in self._regions.values()]

    def _window(self, name: str, offset: int, byte_size: int, what: str) -> tuple[Region, int]:
        """The region and the mapping index of ``offset``, after the bounds check."""
        self._check_enabled()
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise _unknown(name, what)
        size = region.byte_size
        if not _is_size(offset) or offset >= size:
            raise invalid(
                f"{what}: Invalid offset for shared memory region: '{name}' (offset "
                f"{offset!r} of its {size} bytes)"
            )
        if not _is_size(byte_size) or offset + byte_size > size:
            raise invalid(
                f"{what}: Invalid offset + byte size for shared memory region: '{name}' "
                f"(offset {offset!r} + byte_size {byte_size!r} is outside its {size} bytes)"
            )
        return region, region.base + offset

    def check(self, name: str, offset: int, byte_size: int, what: str) -> None:
        """Raise INVALID_ARG unless the window lies inside a registered region
        (lets an adapter refuse a bad output window before running the model)."""
        self._window(name, offset, byte_size, what)

    def view(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        """A zero-copy, read-only, bounds-checked view of ``byte_size`` bytes of a
        region. The view keeps the mapping alive, even after unregister."""
        region, start = self._window(name, offset, byte_size, what)
        return memoryview(region.mapping)[start : start + byte_size].toreadonly()

    def write(
        self, name: str, offset: int, byte_size: int, data: bytes | memoryview, what: str
    ) -> None:
        """Copy ``data`` to ``offset`` of a region. The window the caller declared
        (``offset``, ``byte_size``) must lie inside the region and ``data`` must fit
        in it; otherwise INVALID_ARG and nothing is written."""
        raw = memoryview(data).cast("B") if isinstance(data, memoryview) else data
        region, start = self._window(name, offset, byte_size, what)
        if len(raw) > byte_size:
            raise invalid(
                f"{what}: needs {len(raw)} bytes but shared_memory_byte_size is "
                f"{byte_size} in region '{name}'"
            )
        region.mapping[start : start + len(raw)] = raw


def _unknown(name: str, what: str) -> ApplianceError:
    return invalid(f"{what}: Unable to find shared memory region: '{name}'")
