"""scripts/test.sh's own bookkeeping, run with bash: the functions that time its steps.

A step run in the background (the 3.10 install, the install matrix) records its own
end, so its printed time is how long it ran, not how long until the script came round
to collect it. bash's SECONDS is set by hand here (assigning it sets the counter), so
nothing depends on the machine's speed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "test.sh"


def _functions(*names: str) -> str:
    text = SCRIPT.read_text(encoding="utf-8")
    found = [re.search(rf"^{n}\(\) \{{.*?^\}}\n", text, re.M | re.S) for n in names]
    assert all(found), names
    return "".join(m.group(0) for m in found if m)


def test_a_background_step_is_timed_to_its_own_end(tmp_path: Path) -> None:
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    script = _functions("record", "background", "collect") + """
set -euo pipefail
times=()
ran_for_7s() { SECONDS=7; echo "its output"; }
SECONDS=0
background "$LOG" ran_for_7s &
pid=$!
SECONDS=100  # the steps in front of it took this long
collect "$pid" "$LOG" "install (beside)" 0
printf '%s\\n' "${times[@]}"
"""
    done = subprocess.run(
        ["bash", "-c", script],
        env={"LOG": str(tmp_path / "step.log"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "its output",
        "test.sh: install (beside) took 7 s",
        "install (beside): 7 s",
    ]
