"""What ``jetson-stats`` (jtop) reports, when it is installed and its service runs.

jtop's service runs as root and so can read what a sandboxed server cannot: the
memory controller's clock and bandwidth use (debugfs). Its client is a thread that
keeps the latest values; it is started once, off the event loop, and a scrape only
reads what it last received. Without jtop (or without its service) this source is
absent.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
from typing import Any

from appliance.telemetry import families as f

log = logging.getLogger(__name__)
SOCKET = "run/jtop.sock"


class Jtop:
    name = "jtop"

    def __init__(self) -> None:
        self.client: Any = None
        self._thread = threading.Thread(target=self._start, name="jtop-client", daemon=True)
        self._thread.start()

    @classmethod
    def discover(cls, root: str) -> Jtop | None:
        if root != "/" or not os.path.exists(os.path.join(root, SOCKET)):
            return None
        if importlib.util.find_spec("jtop") is None:
            return None
        return cls()

    def _start(self) -> None:
        try:
            client = importlib.import_module("jtop").jtop()
            client.start()
        except Exception as exc:  # no service, no permission, a version mismatch
            log.info("jetson-stats is installed but its service did not answer: %s", exc)
            return
        self.client = client

    def read(self, out: list[f.Sample]) -> None:
        client = self.client
        if client is None or not client.is_alive():
            return
        try:
            emc = client.memory.get("EMC") or {}
        except Exception:  # the service went away
            return
        if isinstance(emc.get("val"), (int, float)):
            out.append(f.Sample(f.EMC_UTILIZATION, ("jtop",), emc["val"] / 100))
        if isinstance(emc.get("cur"), (int, float)) and emc["cur"] > 1:
            out.append(f.Sample(f.EMC_FREQUENCY, ("jtop",), emc["cur"] * 1000.0))

    def describe(self) -> str:
        return "jetson-stats: " + ("connected" if self.client is not None else "no service")

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:
                log.debug("closing jtop: %s", exc)
