"""Engines shared by the instances of one model: built once, reference-counted.

OpenVINO and TensorRT keep the weights in one compiled model / engine and give each
instance only its own execution state (an infer request, an execution context).
The N instances of a model are created concurrently, each on its own worker
thread; the first to ask for a key builds the engine while the others wait on that
key alone (other models keep loading in parallel), and the last to release it
closes it.

A key must name everything the engine depends on: the loaded copy
(``BackendOptions.share_group``, so a hot swap's new copy never shares with the old
one and each copy's memory is its own), the model file's identity (size and mtime)
and the build settings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(eq=False)
class _Entry(Generic[V]):
    lock: threading.Lock = field(default_factory=threading.Lock)
    refs: int = 0
    value: V | None = None
    built: bool = False
    error: BaseException | None = None


class Lease(Generic[V]):
    """One instance's hold on a shared engine; ``release`` it exactly once (idempotent)."""

    def __init__(self, cache: SharedCache[V], key: Hashable, value: V, first: bool) -> None:
        self.value = value
        self.first = first  # this lease built the engine (and is charged its memory)
        self._cache = cache
        self._key = key
        self._released = False

    def release(self) -> None:
        """Give the engine back; ``value`` is gone afterwards (a closed instance must not
        keep the last reference to an engine the cache has let go)."""
        if not self._released:
            self._released = True
            del self.value
            self._cache._release(self._key)


class SharedCache(Generic[V]):
    """Values built at most once per key and closed with the last lease.

    Thread-safe. ``acquire`` blocks while another thread builds the same key. If the
    build raises, every thread waiting for that key gets the same error, and once
    they have all let go the key is forgotten, so a later load tries again.
    """

    def __init__(self, close: Callable[[V], None]) -> None:
        self._close = close
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Entry[V]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def acquire(self, key: Hashable, build: Callable[[], V]) -> Lease[V]:
        with self._lock:
            entry = self._entries.setdefault(key, _Entry())
            entry.refs += 1
        try:
            with entry.lock:
                first = not entry.built
                if first:
                    if entry.error is not None:
                        raise entry.error
                    try:
                        entry.value = build()
                    except BaseException as exc:
                        entry.error = exc
                        raise
                    entry.built = True
        except BaseException:
            self._release(key)
            raise
        value: V = entry.value  # type: ignore[assignment]  # built is True
        return Lease(self, key, value, first)

    def _release(self, key: Hashable) -> None:
        with self._lock:
            entry = self._entries[key]
            entry.refs -= 1
            if entry.refs > 0:
                return
            del self._entries[key]
        if entry.built and entry.value is not None:
            self._close(entry.value)


def file_identity(*paths: Path) -> tuple[tuple[str, int, int], ...]:
    """(resolved path, size, mtime_ns) of each existing file: part of a cache key."""
    out = []
    for p in paths:
        path = p.resolve()
        if path.exists():
            st = path.stat()
            out.append((str(path), st.st_size, st.st_mtime_ns))
    return tuple(out)
