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
