"""Small raw-HTTP helpers for tests that need status codes tritonclient hides."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any


def post_json(url: str, doc: dict[str, Any]) -> tuple[int, str]:
    """POST ``doc`` as JSON; return (status, body text), error statuses included."""
    request = urllib.request.Request(url, data=json.dumps(doc).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric_value(metrics_url: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` with exactly ``labels`` on the metrics page, or
    None when there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


class Responses:
    """HTTP/1.1 responses read off one socket in order; bytes of a next response that
    arrive with one are kept for the next :meth:`read`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = b""

    def _more(self, what: str) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"closed {what}: {self.data[:200]!r}"
        self.data += chunk

    def read(self) -> tuple[int, dict[str, str], bytes]:
        """The next response: (status, lower-cased headers, body)."""
        while b"\r\n\r\n" not in self.data:
            self._more("before a response")
        head, _, rest = self.data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        self.data = rest
        while len(self.data) < length:
            self._more("in the middle of a response body")
        body, self.data = self.data[:length], self.data[length:]
        return int(lines[0].split()[1]), headers, body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP response (status, lower-cased headers, body) off ``sock``."""
    return Responses(sock).read()


def simple_body() -> bytes:
    """A JSON inference request for the demo ``simple`` model (both inputs all ones)."""
    inputs = [
        {"name": n, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
        for n in ("INPUT0", "INPUT1")
    ]
    return json.dumps({"inputs": inputs}).encode()
