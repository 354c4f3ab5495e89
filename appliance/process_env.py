"""The engines' call-outs, switched off in every process before an engine is imported.

The appliance contacts only what its config names (the MQTT broker, the OTA update
repository, the endpoints a config gives); the engines it loads would contact more:

- ONNX Runtime 1.29 and later (Linux, macOS; x86-64 and aarch64 wheels alike) start
  Microsoft's 1DS telemetry uploader when the library is imported: it writes a device
  id and an event store under ``~/.cache/Microsoft/DeveloperTools/.onnxruntime`` and
  keeps resolving ``mobile.events.data.microsoft.com`` with back-off.
  ``disable_telemetry_events()`` does not stop it; ``ORT_DISABLE_TELEMETRY=1`` set
  before the import does (nothing is created or sent), and ``ORT_TELEMETRY_DISABLED=1``
  is the spelling newer sources and onnxruntime-genai read. Releases before 1.29 read
  neither and send nothing.
- ``import openvino`` imports its model converter, which sends a Google Analytics event
  through ``openvino-telemetry`` (a dependency pip installs with openvino) and writes a
  client id under ``~/intel``. OpenVINO falls back to its own no-op stub when that
  package cannot be imported, so it is made unimportable here.

:func:`apply` runs when the ``appliance`` package is imported, so it precedes every
engine import of the server, its process-isolated workers (fresh interpreters that
import the package too, with this environment inherited), ``perf``, ``tune``,
``doctor``, the OTA agent and the in-process API. A program that imported an engine
before ``appliance`` is told so once: its uploader may already run.
docs/security.md ("What the appliance contacts") has the evidence.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("appliance")

# environment variable -> value, set before any engine is imported
ENVIRONMENT = {
    "ORT_DISABLE_TELEMETRY": "1",  # onnxruntime >= 1.29: no 1DS uploader at all
    "ORT_TELEMETRY_DISABLED": "1",  # the same opt-out as newer sources spell it
}
# Python packages that only call out: made unimportable (openvino uses a stub instead)
BLOCKED_MODULES = ("openvino_telemetry",)
# the engines whose call-outs the two above stop, if they were imported first
_ENGINES = ("onnxruntime", "openvino", "openvino_telemetry")

_applied = False


def apply() -> None:
    """Set :data:`ENVIRONMENT` and block :data:`BLOCKED_MODULES` (idempotent)."""
    global _applied
    if _applied:
        return
    _applied = True
    early = [name for name in _ENGINES if sys.modules.get(name) is not None]
    os.environ.update(ENVIRONMENT)
    for name in BLOCKED_MODULES:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
    if early:
        log.warning(
            "%s imported before appliance: its telemetry may already be running "
            "(docs/security.md); import appliance first",
            ", ".join(early),
        )
