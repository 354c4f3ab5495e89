"""Request headers forwarded as request parameters (Triton's
``--http-header-forward-pattern`` and ``--grpc-header-forward-pattern``): a header whose
name the configured pattern finds becomes a string parameter the model reads
(``request.parameters()``); a header named as one of Triton's reserved parameters, or
starting with ``triton_``, is refused with Triton's text. Shared by the HTTP and gRPC
wires; the pattern is compiled once per text (``ServerConfig.header_pattern``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from appliance.adapters.request_form import RequestForm
from appliance.config.server_config import header_pattern
from appliance.errors import invalid

# Triton's reserved parameter names (besides every name starting with triton_)
RESERVED = (
    "sequence_id",
    "sequence_start",
    "sequence_end",
    "priority",
    "timeout",
    "headers",
    "binary_data_output",
)

Headers = tuple[tuple[str, str], ...]


@functools.lru_cache(maxsize=8)
def _compiled(text: str) -> re.Pattern[str] | None:
    return header_pattern(text)


def select(headers: Iterable[tuple[str, str]], pattern: str) -> Headers:
    """The headers whose names ``pattern`` finds (none when it is "")."""
    regex = _compiled(pattern) if pattern else None
    if regex is None:
        return ()
    return tuple((k, v) for k, v in headers if regex.search(k))


def apply(form: RequestForm, headers: Headers) -> None:
    """Add the selected ``headers`` to the form's parameters, as strings."""
    for name, value in headers:
        if name in RESERVED or name.startswith("triton_"):
            raise invalid(f"Header '{name}' is reserved for Triton usage and cannot be forwarded.")
        form.parameters[name] = value
