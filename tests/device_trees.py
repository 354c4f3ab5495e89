"""The recorded sysfs trees (tests/telemetry/trees, sources in its README) for any test
that needs a device's telemetry this machine does not have."""

from __future__ import annotations

import shutil
from pathlib import Path

from appliance.telemetry.device import Telemetry

TREES = Path(__file__).parent / "telemetry" / "trees"
JETSON = TREES / "jetson-orin-nano"
X86 = TREES / "x86-intel"


def recorded(tree: Path) -> Telemetry:
    """The telemetry a device with this tree would expose (no NVML, no jetson-stats)."""
    return Telemetry.discover(str(tree), libraries=False)


def writable(tree: Path, tmp_path: Path) -> Path:
    """A copy to change (links kept as links, so they resolve inside the copy)."""
    root = tmp_path / tree.name
    shutil.copytree(tree, root, symlinks=True)
    return root
