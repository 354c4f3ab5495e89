"""Triton's system shared-memory extension: registered POSIX shm regions.

A camera process writes a frame into a POSIX shared-memory object, registers it
once (name, key, offset, byte_size), and then sends requests that point at the
region instead of carrying the bytes. Inputs are read as zero-copy views of the
mapping; outputs are written straight into it.

Safety: off unless the server config enables it (Triton asks for the same
opt-in); every access is bounds-checked against the registered window, so a
request can never read or write outside it. Unregistering a region that
in-flight requests still view is safe: the mapping is closed only when the last
view is released (numpy arrays keep the mmap alive through their buffer).
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError, Code, invalid, not_found

SHM_DIR = Path("/dev/shm")  # where Linux exposes POSIX shared-memory objects


@dataclass(slots=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


class SharedMemoryRegistry:
    """Registered regions by name. Methods run on the event loop; a lock guards the map
    because worker threads may also resolve views (it is cheap and uncontended)."""

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
        self._check_enabled()
        if not name:
            raise invalid("a shared-memory region needs a name")
        if offset < 0 or byte_size <= 0:
            raise invalid(f"shared-memory region '{name}': offset must be >= 0 and byte_size > 0")
        path = SHM_DIR / key.lstrip("/")
        if "/" in key.lstrip("/") or not key.lstrip("/"):
            raise invalid(f"shared-memory key {key!r} is not a POSIX shared-memory name")
        with self._lock:
            if name in self._regions:
                raise ApplianceError(
                    Code.INVALID_ARG, f"shared-memory region '{name}' is already registered"
                )
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise invalid(f"cannot open shared-memory key {key!r}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise invalid(
                    f"shared-memory region '{name}': offset {offset} + byte_size "
                    f"{byte_size} exceeds the {size} bytes of key {key!r}"
                )
            mapping = mmap.mmap(fd, offset + byte_size)
        finally:
            os.close(fd)
        with self._lock:
            self._regions[name] = Region(name, key, offset, byte_size, mapping)

    def unregister(self, name: str = "") -> None:
        """Forget one region (or all with ``name == ""``). The mapping stays valid for
        arrays that still view it and is freed with the last of them."""
        self._check_enabled()
        with self._lock:
            if name:
                if self._regions.pop(name, None) is None:
                    raise not_found(f"shared-memory region '{name}' is not registered")
            else:
                self._regions.clear()

    def status(self, name: str = "") -> list[dict[str, Any]]:
        self._check_enabled()
        with self._lock:
            if name:
                region = self._regions.get(name)
                if region is None:
                    raise not_found(f"shared-memory region '{name}' is not registered")
                return [region.status()]
            return [r.status() for r in self._regions.values()]

    def _window(self, name: str, offset: int, byte_size: int, what: str) -> tuple[Region, int]:
        self._check_enabled()
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise invalid(f"{what}: shared-memory region '{name}' is not registered")
        if offset < 0 or byte_size < 0 or offset + byte_size > region.byte_size:
            raise invalid(
                f"{what}: offset {offset} + byte_size {byte_size} is outside region "
                f"'{name}' ({region.byte_size} bytes)"
            )
        return region, region.offset + offset

    def view(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        """A zero-copy, bounds-checked view of ``byte_size`` bytes of a region."""
        region, start = self._window(name, offset, byte_size, what)
        return memoryview(region.mapping)[start : start + byte_size]

    def write(
        self, name: str, offset: int, byte_size: int, data: bytes | memoryview, what: str
    ) -> None:
        """Copy ``data`` into a region; it must fit in the ``byte_size`` the caller gave."""
        if len(data) > byte_size:
            raise invalid(
                f"{what}: {len(data)} bytes do not fit in the {byte_size} bytes "
                f"given for region '{name}'"
            )
        region, start = self._window(name, offset, len(data), what)
        region.mapping[start : start + len(data)] = data
