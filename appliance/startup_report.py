"""What the start-up log says once the initial loads ran, so it agrees with readiness.

One line when every model asked for is READY; otherwise an error naming each model
that failed and why, and the server reports itself not ready (``/v2/health/ready``
answers 400 for the same reason). An empty repository is served with a warning.
A memory budget that admits none of the models asked for is a configuration error:
the server refuses to start instead of running with nothing loaded. A budget that
does not fit under the process's own cgroup limit (systemd's ``MemoryMax=``, a
container's memory limit) is warned about: the kernel would kill the server before
the budget could refuse a model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.config.fields import ConfigError
from appliance.core.memory import fmt
from appliance.core.repository import model_folder_hint

log = logging.getLogger("appliance.server")

SERVER_BASELINE = 128 * 2**20  # the server's own idle RSS, 92-109 MiB, with headroom
# (benchmarks/results/2026-11-30-footprint*.md)

# the phrase Admission.refusal (memory.py) puts in every budget refusal
_BUDGET = "but the memory budget is"


@dataclass(frozen=True, slots=True)
class StartupSummary:
    ready_versions: int
    models: int  # models in the repository
    failed: dict[str, str] = field(default_factory=dict)  # model -> reason


def summarize(index: list[dict[str, Any]]) -> StartupSummary:
    """Read the repository index (``ModelLifeCycle.index()``) after the start-up loads."""
    failed: dict[str, str] = {}
    ready = 0
    for row in index:
        state = row.get("state")
        if state == "READY":
            ready += 1
        elif state == "UNAVAILABLE" and row.get("reason") not in (None, "", "unloaded"):
            version = f" version {row['version']}" if "version" in row else ""
            reason = str(row["reason"])
            failed[row["name"]] = (f"{failed[row['name']]}; " if row["name"] in failed else "") + (
                f"{version.strip()}: {reason}" if version else reason
            )
    return StartupSummary(ready, len({row["name"] for row in index}), failed)


def cgroup_memory_max(proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """This process's cgroup v2 memory.max in bytes; None when unlimited or unknown."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
        path = next(line[3:] for line in lines if line.startswith("0::"))
        text = Path(f"/sys/fs/cgroup{path}/memory.max").read_text().strip()
    except (OSError, StopIteration):
        return None
    return int(text) if text.isdigit() else None


def check_cgroup(memory_limit: int | None, memory_max: int | None) -> None:
    """Warn when the budget does not fit under the cgroup's limit with the baseline."""
    if memory_max is None:
        return
    if memory_limit is None or memory_limit + SERVER_BASELINE > memory_max:
        log.warning(
            "memory_limit is %s but this process may use at most %s (cgroup memory.max, "
            "e.g. systemd's MemoryMax): set memory_limit to at most %s, or the kernel "
            "kills the server before the budget refuses a model",
            fmt(memory_limit),
            fmt(memory_max),
            fmt(max(0, memory_max - SERVER_BASELINE)),
        )


def report(
    summary: StartupSummary, repository: Path, elapsed_s: float, memory_limit: int | None
) -> None:
    """Log the outcome of the start-up loads; ConfigError when the budget admits nothing."""
    check_cgroup(memory_limit, cgroup_memory_max())
    hint = model_folder_hint(repository)
    if hint:
        log.warning("%s", hint)
    no_room = all(_BUDGET in reason for reason in summary.failed.values())
    if summary.failed and summary.ready_versions == 0 and memory_limit is not None and no_room:
        raise ConfigError(
            "<server>",
            "memory_limit",
            f"the memory budget of {fmt(memory_limit)} admits none of the models: "
            + "; ".join(summary.failed.values()),
        )
    if summary.models == 0:
        log.warning(
            "ready in %.2fs, but the model repository %s has no models: "
            "nothing will be served (a model is a folder with numbered version folders)",
            elapsed_s,
            repository,
        )
        return
    if summary.failed:
        log.error(
            "NOT ready after %.2fs: %d model(s) failed to load, %d model version(s) "
            "serving from %s; failed: %s",
            elapsed_s,
            len(summary.failed),
            summary.ready_versions,
            repository,
            "; ".join(f"'{name}': {reason}" for name, reason in sorted(summary.failed.items())),
        )
        return
    log.info(
        "ready in %.2fs: %d model version(s) from %s",
        elapsed_s,
        summary.ready_versions,
        repository,
    )
