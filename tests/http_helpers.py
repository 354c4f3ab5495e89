"""Small raw-HTTP helpers for tests that need status codes tritonclient hides."""

from __future__ import annotations

import json
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
