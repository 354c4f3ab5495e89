"""kill -9 of the agent at every software phase, with and without the server killed
too (a power cut), converges on one version: the state's, the link's and the one that
answers. A module of its own, beside tests/ota/test_ota_software.py, with its own
device and repository (the ``site`` fixture): the two modules run on different
workers of the suite.
"""

from __future__ import annotations

import pytest

from tests.ota_device import appliance
from tests.ota_software import Site

PHASES = [
    "software:install",
    "software:flip",
    "software:restart",
    "software:watch",
    "software:committed",
    "software:rollback",
]
# each phase killed alone, and with the server killed too (a power cut) from the flip
# on: before it the server runs the committed version, which a power cut only restarts
POINTS = [(phase, False) for phase in PHASES]
POINTS += [(phase, True) for phase in PHASES if phase != "software:install"]


@pytest.mark.parametrize(("point", "power_cut"), POINTS,
                         ids=[p + "+power" * c for p, c in POINTS])  # fmt: skip
def test_killed_at_any_software_phase_converges(site: Site, point: str, power_cut: bool) -> None:
    old = site.committed
    broken = point == "software:rollback"
    new = site.publish(broken=broken)
    args = ("ota", "agent", "--once", "--config", str(site.device.config))
    killed = appliance(*args, check=False, env={"APPLIANCE_OTA_KILL_AT": point}, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    if power_cut:
        site.supervisor.power_cut()
    again = appliance(*args, check=False, timeout=300)
    assert again.returncode in (0, 1), again.stderr[-2000:]
    site.agrees(old if broken else new)
