"""A one-shot timer on the event loop with microsecond resolution: a Linux ``timerfd``
the loop watches like a socket.

The loop's own timers cannot wait a sub-millisecond queue delay: uvloop's (libuv's)
have millisecond resolution and fire a ``call_later(0.0001)`` on the next turn, so a
wait built on them spins the loop; asyncio's own loop rounds it up to about a
millisecond. The kernel keeps a ``timerfd`` to the microsecond, and its expiry wakes
the loop's ``epoll`` as a readable socket does: nothing spins and no thread wakes.

Linux only (x86-64 and arm64 alike): ``os.timerfd_create`` where Python has it (3.13+),
else the C library's ``timerfd_create``/``timerfd_settime`` through ctypes.
:meth:`LoopTimer.create` answers None where neither is there, and the caller keeps its
thread-based wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
from collections.abc import Callable

_CLOCK_MONOTONIC = 1  # (Linux's clock id, the same on every architecture)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc_timerfd() -> tuple[Callable[[], int], Callable[[int, int], None]] | None:
    """timerfd_create and a one-shot settime from the C library, or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    flags = os.O_NONBLOCK | os.O_CLOEXEC  # (TFD_NONBLOCK | TFD_CLOEXEC)

    def make() -> int:
        fd = int(create(_CLOCK_MONOTONIC, flags))
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        return fd

    def set_ns(fd: int, ns: int) -> None:
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(ns // 1_000_000_000, ns % 1_000_000_000))
        if settime(fd, 0, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    return make, set_ns


def _os_timerfd() -> tuple[Callable[[], int], Callable[[int, int], None]] | None:
    if not hasattr(os, "timerfd_create"):
        return None

    def make() -> int:
        flags = os.TFD_NONBLOCK | os.TFD_CLOEXEC  # type: ignore[attr-defined,unused-ignore]
        fd: int = os.timerfd_create(_CLOCK_MONOTONIC, flags=flags)  # type: ignore[attr-defined,unused-ignore]
        return fd

    def set_ns(fd: int, ns: int) -> None:
        os.timerfd_settime_ns(fd, initial=ns)  # type: ignore[attr-defined,unused-ignore]

    return make, set_ns


@functools.cache
def _timerfd() -> tuple[Callable[[], int], Callable[[int, int], None]] | None:
    return _os_timerfd() or _libc_timerfd()


class LoopTimer:
    """One timer, armed for one deadline at a time; ``fired`` runs on the loop when it
    expires. Re-arming replaces the deadline; :meth:`disarm` drops it (an expiry the
    loop has seen but not yet handled is dropped too: the kernel's count is reset)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fired: Callable[[], None],
        fd: int,
        set_ns: Callable[[int, int], None],
    ) -> None:
        self._loop, self._fired, self._fd, self._set_ns = loop, fired, fd, set_ns
        self.armed = False
        loop.add_reader(fd, self._expired)

    @classmethod
    def create(cls, loop: asyncio.AbstractEventLoop, fired: Callable[[], None]) -> LoopTimer | None:
        """A timer on ``loop``; None where the system has no ``timerfd``."""
        timerfd = _timerfd()
        if timerfd is None:
            return None
        make, set_ns = timerfd
        try:
            fd = make()
        except OSError:  # (out of descriptors: the caller waits the other way)
            return None
        try:
            return cls(loop, fired, fd, set_ns)
        except BaseException:
            os.close(fd)
            raise

    def arm(self, delay_s: float) -> None:
        """Fire once, ``delay_s`` from now (at least a microsecond: 0 would disarm)."""
        self._set_ns(self._fd, max(1_000, int(delay_s * 1e9)))
        self.armed = True

    def disarm(self) -> None:
        if self.armed:
            self._set_ns(self._fd, 0)
            self.armed = False

    def close(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(RuntimeError):  # (the loop is closed already)
            self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        self.armed = False

    def _expired(self) -> None:
        try:
            os.read(self._fd, 8)  # (the expiry count; resets readiness)
        except BlockingIOError:  # disarmed or re-armed after the loop saw it
            return
        self.armed = False
        self._fired()
