"""One ``appliance doctor`` check's result: ``ok``, ``warn`` or ``fail``, a one-line
summary and details for ``--json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass
class Check:
    name: str
    status: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
