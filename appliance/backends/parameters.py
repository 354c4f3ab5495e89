"""Typed reads of a model config's ``parameters`` (all strings) for backends.

The config module already turned Triton's ``{key: {string_value: ...}}`` into plain
strings; here a backend reads the keys it understands, and an invalid value names
the model, the parameter and what was expected.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from appliance.errors import invalid


class Parameters:
    """The parameters of one model as one backend reads them."""

    def __init__(self, model: str, values: Mapping[str, str]) -> None:
        self.model = model
        self.values = values

    def _fail(self, key: str, expected: str, got: str) -> Exception:
        return invalid(f"model '{self.model}': parameters.{key}: expected {expected}, got {got!r}")

    def raw(self, *keys: str) -> tuple[str, str] | None:
        """(key, value) of the first of ``keys`` present (aliases, e.g. Triton's
        upper-case names), or None."""
        for key in keys:
            if key in self.values:
                return key, self.values[key].strip()
        return None

    def choice(self, keys: Iterable[str], choices: Iterable[str], default: str) -> str:
        """A value from ``choices`` (matched case-insensitively), returned as spelled
        in ``choices``."""
        names = tuple(keys)
        found = self.raw(*names)
        if found is None:
            return default
        key, value = found
        options = {c.upper(): c for c in choices}
        if value.upper() not in options:
            raise self._fail(key, f"one of {sorted(options.values())}", value)
        return options[value.upper()]

    def integer(self, keys: Iterable[str], default: int, minimum: int = 0) -> int:
        found = self.raw(*tuple(keys))
        if found is None:
            return default
        key, value = found
        if not value.lstrip("-").isdigit() or int(value) < minimum:
            raise self._fail(key, f"an integer >= {minimum}", value)
        return int(value)

    def flag(self, keys: Iterable[str], default: bool) -> bool:
        found = self.raw(*tuple(keys))
        if found is None:
            return default
        key, value = found
        truthy, falsy = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}
        if value.lower() not in truthy | falsy:
            raise self._fail(key, "true or false", value)
        return value.lower() in truthy
