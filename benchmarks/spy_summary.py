"""Summarise py-spy's collapsed stacks (``--format raw``): where the sampled CPU time
went, by function, self and inclusive (samples of a thread waiting on a lock left
out). Next to the scripts, like ``machine.py``::

    python benchmarks/spy_summary.py PROFILE.txt [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

# leaves that are a thread waiting, not running: py-spy counts a timed lock wait as
# active (an idle instance thread waits for work on a Condition)
WAITING = ("Condition.wait (threading.py", "Event.wait (threading.py")


def summarise(path: Path, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if not frames or frames[-1].startswith(WAITING):
            continue
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    rows = [f"{total} samples ({path.name})", "", "| self % | incl % | function |", "|---|---|---|"]
    for frame, n in own.most_common(top):
        rows.append(f"| {100 * n / total:.1f} | {100 * inclusive[frame] / total:.1f} | `{frame}` |")
    rows += ["", "| incl % | function (inclusive) |", "|---|---|"]
    for frame, n in inclusive.most_common(top):
        rows.append(f"| {100 * n / total:.1f} | `{frame}` |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("profiles", type=Path, nargs="+")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    for p in args.profiles:
        print(summarise(p, args.top), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
