"""The disk-space rule: an update starts only when it fits, and never fills a disk.

Before a download the agent needs, on the state folder's file system, the bytes of
the bundle still to fetch, and on the model repository's, the bundle's unpacked
size (its files as the signed target declares them); both on top of
``reserve_disk``, which is always left free (the server, logs and the state file
need room too). When the two folders share a file system the needs add up.
Before staging the same holds for the manifest's own sizes. A shortfall is a
:class:`~appliance.ota.Transient` refusal with a one-line reason (reported to the fleet):
nothing is marked bad, partial files are removed, and the next check tries again,
so the device recovers by itself once space is freed. A write that still fails
with ENOSPC (space taken meanwhile) is handled the same way (:func:`is_full`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from appliance.ota import Transient

FULL = (errno.ENOSPC, errno.EDQUOT)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    st = os.statvfs(_existing(path))
    return st.f_bavail * st.f_frsize


def require(needs: dict[Path, int], reserve: int, what: str) -> None:
    """Transient naming the folder and the figures when ``needs`` (bytes per folder)
    do not fit next to ``reserve`` free bytes on each file system."""
    per_device: dict[int, tuple[Path, int]] = {}
    for folder, needed in needs.items():
        dev = os.stat(_existing(folder)).st_dev
        first, total = per_device.get(dev, (folder, 0))
        per_device[dev] = (first, total + max(0, needed))
    for folder, needed in per_device.values():
        free = free_bytes(folder)
        if needed + reserve > free:
            raise Transient(
                f"not enough disk space for {what}: it needs {needed} bytes in {folder} "
                f"and {reserve} are kept free, but only {free} are free"
            )


def is_full(exc: OSError) -> bool:
    return exc.errno in FULL
