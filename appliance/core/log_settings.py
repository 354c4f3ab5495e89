"""Triton's logging extension: the server's log settings, read and changed at run time.

``log_info``, ``log_warning``, ``log_error`` (bools) and ``log_verbose_level`` (an
integer; above 0 means debug lines) set the level of the root logger, so a change
takes effect at once for every module. ``log_format`` is ``default`` (the format
the server started with) or ``ISO8601`` (each line starts with its UTC time as
``2026-12-04T17:30:00Z``, as Triton's). ``log_file`` is reported ("" = standard error) but
cannot be changed through the network protocol: a path a client could set would
let it write files anywhere the server can.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from appliance.errors import invalid

_BOOLS = ("log_info", "log_warning", "log_error")
_FORMATS = ("default", "ISO8601")
# each root handler's formatter as the server started, put back by log_format default
_STARTED: dict[logging.Handler, logging.Formatter | None] = {}


def _set_format(name: str) -> None:
    for handler in logging.getLogger().handlers:
        _STARTED.setdefault(handler, handler.formatter)
        if name == "ISO8601":
            iso = logging.Formatter(
                "%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%SZ"
            )
            iso.converter = time.gmtime
            handler.setFormatter(iso)
        else:
            handler.setFormatter(_STARTED[handler])


class LogSettings:
    """The log settings in force; :meth:`update` applies changes to ``logging``."""

    def __init__(self, level: str = "info") -> None:
        level = level.lower()
        self._settings: dict[str, Any] = {
            "log_file": "",
            "log_info": level in ("debug", "info"),
            "log_warning": level in ("debug", "info", "warning"),
            "log_error": True,
            "log_verbose_level": 1 if level == "debug" else 0,
            "log_format": "default",
        }

    def settings(self) -> dict[str, Any]:
        return dict(self._settings)

    def update(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Validate every change first, then apply them all; returns the settings."""
        new = dict(self._settings)
        for key, value in changes.items():
            if key in _BOOLS:
                if not isinstance(value, bool):
                    raise invalid(f"{key} must be true or false, got {value!r}")
            elif key == "log_verbose_level":
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise invalid(f"log_verbose_level must be an integer >= 0, got {value!r}")
            elif key == "log_format":
                if value not in _FORMATS:
                    raise invalid(
                        f"log_format {value!r} is not supported; expected 'default' or 'ISO8601'"
                    )
            elif key == "log_file":  # any value, as Triton: a path is the server's choice
                if value is None:
                    continue
                raise invalid(
                    "log file location can not be updated through network protocol "
                    "(set it in the server config)"
                )
            else:
                raise invalid(f"unknown log setting '{key}'; expected one of {sorted(new)}")
            new[key] = value
        if new["log_format"] != self._settings["log_format"]:
            _set_format(new["log_format"])
        self._settings = new
        logging.getLogger().setLevel(self.level())
        return self.settings()

    def level(self) -> int:
        s = self._settings
        if s["log_verbose_level"] > 0:
            return logging.DEBUG
        if s["log_info"]:
            return logging.INFO
        if s["log_warning"]:
            return logging.WARNING
        if s["log_error"]:
            return logging.ERROR
        return logging.CRITICAL + 1
