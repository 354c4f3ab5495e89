"""The systemd side of sd_notify for tests: a datagram socket that collects the
messages a process started with ``NOTIFY_SOCKET`` sends."""

from __future__ import annotations

import socket
import time
from pathlib import Path


class Listener:
    """The systemd side: a datagram socket collecting notify messages."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[dict[str, str]] = []

    def until(self, key: str, value: str, at_least: int = 1, timeout: float = 60) -> None:
        """Receive until ``at_least`` messages carried ``key=value``."""
        deadline = time.monotonic() + timeout
        while self.count(key, value) < at_least:
            left = deadline - time.monotonic()
            assert left > 0, f"{key}={value} x{at_least} never came: {self.messages}"
            self.sock.settimeout(left)
            data = self.sock.recv(65536).decode()
            self.messages.append(dict(line.split("=", 1) for line in data.splitlines()))

    def count(self, key: str, value: str) -> int:
        return sum(1 for m in self.messages if m.get(key) == value)
