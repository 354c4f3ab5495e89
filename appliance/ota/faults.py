"""Named crash points, for the crash-consistency tests.

The agent calls :func:`point` at each phase boundary (``phase:<name>``, right after
the new phase is saved), each time a step starts to run (``step:<name>``: also when a
restarted agent resumes it), inside the commit (``commit:decided``,
``commit:config``, ``commit:cleaned``) and at each step of a software update
(``software:install``, ``software:flip``, ``software:restart``, ``software:watch``,
``software:committed``, ``software:rollback``; :mod:`.abinstall`). When the environment variable
``APPLIANCE_OTA_KILL_AT`` names the point, the process sends itself SIGKILL there:
nothing after it runs (no ``finally``, no buffered write), exactly as a power cut
or ``kill -9`` at that instruction. Unset (always, outside the tests) a point costs
one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "APPLIANCE_OTA_KILL_AT"


def point(name: str) -> None:
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
