"""systemd's service notification protocol (``sd_notify``), without libsystemd.

A ``Type=notify`` unit gives the service ``NOTIFY_SOCKET`` (a datagram socket: a path,
or an abstract name written with a leading ``@``) and, with ``WatchdogSec=``,
``WATCHDOG_USEC`` (and ``WATCHDOG_PID``). :class:`SystemdLink` tells systemd:

- ``READY=1`` once every model asked for is READY: the unit stays "activating" until
  then, so ``systemctl start`` and units ordered after it wait for serving models;
- ``WATCHDOG=1`` every half ``WATCHDOG_USEC``, from a task on the event loop: a loop
  that is stuck (or a process that hangs) stops the pings, and systemd restarts it;
- ``STOPPING=1`` when shutdown begins, and ``STATUS=`` lines ``systemctl status`` shows.

Outside systemd (no ``NOTIFY_SOCKET``) every call is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


def socket_address(value: str) -> str | None:
    """The AF_UNIX address for a ``NOTIFY_SOCKET`` value; None when unusable here."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]  # abstract namespace
    if value.startswith("/"):
        return value
    return None  # e.g. vsock:... (VMs): not used on a device


def watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Seconds between pings (half what systemd asks), or None when no watchdog is set
    for this process (WATCHDOG_PID names another one, e.g. a parent shell)."""
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2e6


class Notifier:
    """Sends notify messages; never raises (a lost message must not stop serving)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self.address = socket_address(raw) if raw else None
        if raw and self.address is None:
            log.warning("NOTIFY_SOCKET %r is not a unix socket: systemd is not notified", raw)
        self.watchdog_s = watchdog_interval(env) if self.address else None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str) -> bool:
        """Send ``KEY=value`` fields as one datagram; False when not sent."""
        if self.address is None:
            return False
        message = "\n".join(fields).encode("utf-8", "replace")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)  # a full socket buffer must never stall the loop
                sock.sendto(message, self.address)
        except OSError as exc:
            if not self._warned:  # once: the watchdog would repeat it every few seconds
                log.warning("cannot notify systemd at %s: %s", self.address, exc)
                self._warned = True
            return False
        return True


class SystemdLink:
    """READY=1 when ``ready()`` first holds, watchdog pings, STOPPING=1 at shutdown."""

    def __init__(
        self,
        ready: Callable[[], bool],
        status: Callable[[], str],
        notifier: Notifier | None = None,
        ready_poll_s: float = 1.0,
    ) -> None:
        self.notifier = notifier or Notifier()
        self._ready = ready
        self._status = status
        self._poll_s = ready_poll_s
        self._task: asyncio.Task[None] | None = None
        self.sent_ready = False
        self.stopping = False

    def start(self) -> None:
        """Start the ping task on the running loop (nothing outside systemd)."""
        if not self.notifier.enabled:
            return
        self._tick()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="systemd-notify")

    def _tick(self) -> None:
        if not self.sent_ready and self._ready():
            self.sent_ready = self.notifier.notify("READY=1", f"STATUS={self._status()}")
        elif not self.sent_ready:
            self.notifier.notify(f"STATUS={self._status()}")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.notifier.watchdog_s
        next_ping = loop.time()
        while True:
            now = loop.time()
            if interval is not None and now >= next_ping:
                self.notifier.notify("WATCHDOG=1")
                next_ping = now + interval
            if not self.stopping:
                self._tick()
            if interval is None:
                if self.sent_ready:
                    return  # no watchdog: nothing more to say until shutdown
                await asyncio.sleep(self._poll_s)
            elif self.sent_ready:
                await asyncio.sleep(max(0.0, next_ping - loop.time()))
            else:
                await asyncio.sleep(max(0.0, min(self._poll_s, next_ping - loop.time())))

    def stopping_now(self) -> None:
        """Tell systemd shutdown began. The watchdog keeps pinging while models drain
        (a drain is bounded by drain_timeout_s and the unit's TimeoutStopSec)."""
        self.stopping = True
        self.notifier.notify("STOPPING=1", "STATUS=draining and unloading")

    async def close(self) -> None:
        """Stop pinging (after shutdown finished)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
