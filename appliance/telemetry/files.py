"""Reading sysfs the cheap way: one ``os.read`` per attribute, failures are ``None``.

Every reader goes through these, so a file that is missing, unreadable (permission,
a power-gated sensor answering EAGAIN), or holding something unexpected is simply
absent from a scrape: never an exception. Paths are built under an injected root
(``/`` on a device, a recorded tree in the tests); sysfs links are relative, so they
resolve inside the same root.
"""

from __future__ import annotations

import os
import re

_MAX = 4096  # sysfs attributes are one page at most
_DIGITS = re.compile(r"(\d+)")


def read_text(path: str) -> str | None:
    """The attribute's text, stripped; None when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, _MAX)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").strip()


def read_int(path: str) -> int | None:
    """An integer attribute (a trailing unit word, as in ``32760 ma``, is ignored)."""
    text = read_text(path)
    if not text:
        return None
    try:
        return int(text.split()[0])
    except ValueError:
        return None


def listdir(path: str) -> list[str]:
    """Entries of a folder in natural order (``zone2`` before ``zone10``); [] if absent."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(names, key=natural)


def natural(name: str) -> list[int | str]:
    return [int(p) if p.isdigit() else p for p in _DIGITS.split(name)]


def exists(path: str) -> bool:
    return os.path.exists(path)


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 6] -> '0-3,6' (the kernel's own list format)."""
    parts: list[str] = []
    for cpu in sorted(set(cpus)):
        if parts and "-" in parts[-1] and int(parts[-1].split("-")[1]) == cpu - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{cpu}"
        elif parts and "-" not in parts[-1] and int(parts[-1]) == cpu - 1:
            parts[-1] = f"{parts[-1]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)
