"""The agent's persisted state: one JSON file, replaced atomically on every change.

Written to a temporary file, fsynced, renamed over ``state.json``, and the folder
fsynced, so after a crash or power cut the file holds either the state before a
step or the one after it, never a mix. Every step of the agent is written before
it is acted on and is safe to redo, which is what makes a restart resume.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# the update's steps, in order; "idle" when no update is under way
PHASES = (
    "idle",
    "check",
    "download",
    "verify",
    "stage",
    "load",
    "self_test",
    "switch",
    "probation",
    "commit",
    "rollback",
)


@dataclass(slots=True)
class Job:
    """The one update under way."""

    model: str
    version: int
    target: str  # the TUF target path
    length: int
    sha256: str
    previous: int = 0  # the version that served before (0: none, a fresh install)
    load_attempts: int = 0
    reason: str = ""  # why it is being rolled back
    old_latency_us: int = 0  # the old version's mean latency, for probation
    # the candidate's counters after its self-test (success, fail, success ns): the
    # switch promotes that copy, so probation counts from here
    tested_counts: list[int] = field(default_factory=list)
    started: float = 0.0  # wall-clock time, for reports only


@dataclass(slots=True)
class ModelState:
    current: int = 0  # the committed version
    previous: list[int] = field(default_factory=list)  # kept on disk for rollback
    bad: list[int] = field(default_factory=list)  # never tried again


@dataclass(slots=True)
class AgentState:
    phase: str = "idle"
    job: Job | None = None
    models: dict[str, ModelState] = field(default_factory=dict)
    last_error: str = ""
    last_check: float = 0.0
    next_check: float = 0.0
    clock_floor: float = 0.0  # the latest wall-clock time this device has seen
    progress: dict[str, int] = field(default_factory=dict)  # bytes done / total
    history: list[dict[str, Any]] = field(default_factory=list)  # last results

    def model(self, name: str) -> ModelState:
        return self.models.setdefault(name, ModelState())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> AgentState:
        job = doc.get("job")
        models = {k: ModelState(**v) for k, v in (doc.get("models") or {}).items()}
        state = cls(
            **{k: v for k, v in doc.items() if k not in ("job", "models")},
            job=Job(**job) if job else None,
            models=models,
        )
        if state.phase not in PHASES:
            raise ValueError(f"unknown phase {state.phase!r}")
        return state


class StateFile:
    """``<state_dir>/state.json``; :meth:`save` is atomic."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.path = state_dir / "state.json"

    def load(self) -> AgentState:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return AgentState()
        return AgentState.from_json(doc)

    def save(self, state: AgentState) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / ".state.json.tmp"
        data = json.dumps(state.to_json(), indent=1, sort_keys=True).encode()
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
