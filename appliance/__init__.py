"""Edge inference appliance: a Triton-compatible inference server for small devices.

``from appliance import InProcessServer`` serves models inside a Python program;
``Server`` is the networked server the ``appliance serve`` command runs. Both are
imported on first use, so ``import appliance`` stays cheap. Importing the package
first switches off the engines' own call-outs for the whole process
(:mod:`appliance.process_env`), before any engine is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from appliance import process_env
from appliance.version import __version__

process_env.apply()

if TYPE_CHECKING:
    from appliance.adapters.inprocess import InProcessServer
    from appliance.errors import ApplianceError
    from appliance.server import Server

_LAZY = {
    "ApplianceError": "appliance.errors",
    "InProcessServer": "appliance.adapters.inprocess",
    "Server": "appliance.server",
}

__all__ = ["ApplianceError", "InProcessServer", "Server", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'appliance' has no attribute {name!r}")
