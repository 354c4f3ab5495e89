"""The typed readers every config shares: one error type naming file, field and
expectation; typed reads of a mapping (:class:`Fields`); sizes ('64MiB', '1.5GB') and
memory limits ('60%', '2GiB').

The bottom of the configuration layer: it imports nothing of the appliance but its
error type, so the server config, model configs and the memory budget can all use it.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

from appliance import names
from appliance.errors import ApplianceError, Code


class ConfigError(ApplianceError):
    """A config file is invalid; the message names file, field and expectation."""

    def __init__(self, source: str, path: str, message: str) -> None:
        where = f"{source}: {path}: " if path else f"{source}: "
        super().__init__(Code.INVALID_ARG, where + message)


_INT = re.compile(r"-?\d+")
INT64_MAX = 2**63 - 1  # every integer of a model config is an int64 (or int32) in Triton's schema


class Fields:
    """Typed reads of one mapping, with errors naming the file and field path."""

    def __init__(self, source: str, data: Any, path: str = "") -> None:
        if not isinstance(data, dict):
            raise ConfigError(source, path, f"expected a mapping, got {type(data).__name__}")
        self.source, self.data, self.path = source, data, path

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(self.source, self.at(key), message)

    def check_keys(self, allowed: set[str]) -> None:
        for key in self.data:
            if key not in allowed:
                near = difflib.get_close_matches(str(key), sorted(allowed), n=1)
                hint = f"did you mean {near[0]}? " if near else ""
                raise self.fail(str(key), f"unknown field, {hint}expected one of {sorted(allowed)}")

    def integer(self, key: str, default: int, minimum: int = 0) -> int:
        value = self.data.get(key, default)
        if isinstance(value, str) and _INT.fullmatch(value):
            value = int(value)  # protobuf JSON writes int64 as strings
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.fail(key, f"expected an integer >= {minimum}, got {value!r}")
        if value > INT64_MAX:
            raise self.fail(key, f"expected an integer of at most 2**63 - 1, got {value!r}")
        return value

    def text(self, key: str, default: str = "") -> str:
        value = self.data.get(key, default)
        if not isinstance(value, str):
            raise self.fail(key, f"expected a string, got {value!r}")
        return value

    def file_name(self, key: str, what: str = "file name") -> str:
        """A name the config gives a file or model: one path component
        (:mod:`appliance.names`), or "" when absent."""
        value = self.text(key)
        problem = names.name_problem(value) if value else ""
        if problem:
            raise self.fail(
                key, f"expected a {what} (one path component), got {value!r}: {problem}"
            )
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {value!r}")
        return value

    def ints(self, key: str, minimum: int) -> tuple[int, ...]:
        value = self.data.get(key, [])
        if isinstance(value, list):  # protobuf JSON writes int64 as strings
            value = [int(v) if isinstance(v, str) and _INT.fullmatch(v) else v for v in value]
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value
        ):
            raise self.fail(key, f"expected a list of integers >= {minimum}, got {value!r}")
        if any(v > INT64_MAX for v in value):
            raise self.fail(key, f"expected integers of at most 2**63 - 1, got {value!r}")
        return tuple(value)

    def entries(self, key: str) -> list[Fields]:
        value = self.data.get(key, [])
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list, got {type(value).__name__}")
        return [Fields(self.source, v, f"{self.at(key)}[{i}]") for i, v in enumerate(value)]

    def sub(self, key: str) -> Fields | None:
        if key not in self.data or self.data[key] is None:
            return None
        return Fields(self.source, self.data[key], self.at(key))


_UNITS = {
    "b": 1,
    "bytes": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_size(value: Any, source: str, key: str) -> int:
    """'64MiB', '1.5GB', '1048576B' -> bytes. A bare number is refused: ``memory_limit:
    60`` meant as 60 MiB must not silently become 60 bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if isinstance(value, bool) or not m or float(m.group(1)) <= 0:
        raise ConfigError(source, key, f"expected a size such as 64MiB or 1.5GB, got {value!r}")
    unit = m.group(2).lower()
    if not unit:
        raise ConfigError(
            source,
            key,
            f"expected a size such as 64MiB or 1.5GB, got {value!r}: a size needs a unit "
            f"({m.group(1)}MiB, {m.group(1)}MB, or {m.group(1)}B for bytes)",
        )
    if unit not in _UNITS:
        raise ConfigError(
            source, key, f"expected a size such as 64MiB or 1.5GB, got {value!r}: unknown unit"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def physical_memory() -> int:
    """Bytes of RAM in this machine."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def parse_limit(value: Any, source: str, key: str) -> int | None:
    """``memory_limit``: a size ('1.5GiB', bytes) or a share of physical RAM ('60%');
    None, 0 or 'none' mean unlimited."""
    if value is None or value == 0 or str(value).strip().lower() in ("", "none", "unlimited"):
        return None
    text = str(value).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise ConfigError(source, key, f"expected a share such as 60%, got {value!r}")
        return int(physical_memory() * share / 100)
    return parse_size(value, source, key)


def seconds(f: Fields, key: str, default: float, minimum: float) -> float:
    """A number of seconds at ``key`` (``default`` when absent), at least ``minimum``."""
    value = f.data.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < minimum:
        raise f.fail(key, f"expected a number of seconds >= {minimum:g}, got {value!r}")
    return float(value)


def existing_path(f: Fields, key: str, base: Path | None, directory: bool = False) -> Path | None:
    """An existing file (or directory) at ``key``, relative to the config file ``base``;
    None when absent."""
    value = f.data.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise f.fail(key, f"expected a path, got {value!r}")
    path = Path(os.path.expanduser(value))
    if base is not None and not path.is_absolute():
        path = base.parent / path  # relative to the config file
    if not (path.is_dir() if directory else path.is_file()):
        kind = "directory" if directory else "file"
        raise f.fail(key, f"expected an existing {kind}, {str(path)!r} is not one")
    return path
