"""The agent's persisted state: one JSON file, replaced atomically on every change.

:meth:`StateFile.save` writes a temporary file and fsyncs it, keeps the file it
replaces as ``state.json.prev`` (a hard link renamed into place), renames the new
one over ``state.json`` and fsyncs the folder: after a crash or power cut
``state.json`` holds the state before a step or the one after it, and
``state.json.prev`` the one before that. :meth:`StateFile.load` never raises on
content: a ``state.json`` that does not parse or validate (a power cut on a file
system without data journaling can leave it truncated) falls back to
``state.json.prev``, and when that is unusable too, to nothing, and the agent
rebuilds its state from the model repository (:func:`appliance.ota.commit.rebuild`).

:class:`StateLock` keeps two agents (a unit restarted while the old process
lingers) from working on one state folder at once: each cycle runs under an
exclusive ``flock`` on ``<state_dir>/lock``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from appliance.ota import OtaError, Transient

# the update's steps, in order; "idle" when no update is under way
PHASES = (
    "idle",
    "check",
    "download",
    "verify",
    "waiting",
    "stage",
    "load",
    "self_test",
    "shadow",
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
    unpacked: int = 0  # the files' size once installed, as the signed target says
    backend: str = ""  # the backend the signed target claims ("": it does not say)
    previous: int = 0  # the version that served before (0: none, a fresh install)
    load_attempts: int = 0
    reason: str = ""  # why it is being rolled back
    old_latency_us: int = 0  # the old version's mean latency, for probation
    # the candidate's counters after its self-test (success, fail, success ns, client
    # errors): the switch promotes that copy, so probation counts from here
    tested_counts: list[int] = field(default_factory=list)
    started: float = 0.0  # wall-clock time the job was taken (reports, job deadline)
    # how often each phase was entered: a phase the agent keeps dying in (killed by
    # the OOM killer while it verifies, say) marks the version bad (ota.agent)
    entries: dict[str, int] = field(default_factory=dict)
    # set by the commit's one atomic state write, together with the model's new
    # current version: from then on the job only finishes (ota.commit)
    committed: bool = False
    bad: bool = True  # whether a rollback marks the version bad (a withdrawal does not)
    result: str = ""  # the result a rollback reports: rolled_back or withdrawn
    probation: dict[str, int] = field(default_factory=dict)  # what probation counted
    probe: str = ""  # the probes self-test and probation sent (ota.probes)
    # the signed delta from ``previous`` (ota.fetching): target, length, sha256, base and
    # the full target's content hashes; emptied when the agent falls back to the full
    # bundle
    delta: dict[str, Any] = field(default_factory=dict)
    download: dict[str, Any] = field(default_factory=dict)  # how it came: full or delta
    shadow: dict[str, Any] = field(default_factory=dict)  # shadow probation's summary
    window_opens: float = 0.0  # while waiting for a maintenance window: when it opens


@dataclass(slots=True)
class ModelState:
    current: int = 0  # the committed version
    previous: list[int] = field(default_factory=list)  # kept on disk for rollback
    bad: list[int] = field(default_factory=list)  # never tried again, unless retried
    # per version, the fleet's retry count (fleet rollout --retry-failed) it was last
    # taken again at: a bad version is taken again once the signed retry is higher
    retried: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class AgentState:
    phase: str = "idle"
    job: Job | None = None
    models: dict[str, ModelState] = field(default_factory=dict)
    last_error: str = ""
    last_check: float = 0.0
    next_check: float = 0.0
    clock_floor: float = 0.0  # the latest time the clock and the repository vouched for
    retries: int = 0  # cycles in a row that failed for a passing reason (back-off)
    progress: dict[str, int] = field(default_factory=dict)  # bytes done / total
    history: list[dict[str, Any]] = field(default_factory=list)  # last results

    def model(self, name: str) -> ModelState:
        return self.models.setdefault(name, ModelState())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any) -> AgentState:
        """Validate a parsed state file; ValueError naming what is wrong. Unknown keys
        (a newer agent's) are ignored, missing ones take their defaults."""
        if not isinstance(doc, dict):
            raise ValueError("expected a JSON object")
        job = doc.get("job")
        raw_models = doc.get("models") or {}
        if not isinstance(raw_models, dict):
            raise ValueError("models: expected an object")
        state = cls(
            **_known(cls, doc, ("job", "models")),
            job=_build(Job, job) if job is not None else None,
            models={str(k): _build(ModelState, v) for k, v in raw_models.items()},
        )
        _check(state)
        return state


def _known(cls: Any, doc: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    names = {f.name for f in fields(cls)} - set(skip)
    return {k: v for k, v in doc.items() if k in names}


def _build(cls: Any, doc: Any) -> Any:
    if not isinstance(doc, dict):
        raise ValueError(f"{cls.__name__}: expected an object")
    try:
        return cls(**_known(cls, doc))
    except TypeError as exc:  # a required field is missing
        raise ValueError(f"{cls.__name__}: {exc}") from None


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(_int(v) for v in values)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(state: AgentState) -> None:
    """The types the agent relies on: a file that parses but holds nonsense is as
    unusable as a truncated one."""
    if state.phase not in PHASES:
        raise ValueError(f"unknown phase {state.phase!r}")
    for name, ms in state.models.items():
        if not (_int(ms.current) and _ints(ms.previous) and _ints(ms.bad)):
            raise ValueError(f"models.{name}: expected integer versions")
        if not isinstance(ms.retried, dict) or not all(_int(v) for v in ms.retried.values()):
            raise ValueError(f"models.{name}.retried: expected retry counts")
    numbers = (state.last_check, state.next_check, state.clock_floor)
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers):
        raise ValueError("last_check, next_check and clock_floor must be numbers")
    if not (_int(state.retries) and isinstance(state.last_error, str)):
        raise ValueError("retries must be an integer, last_error a string")
    if not isinstance(state.history, list) or not isinstance(state.progress, dict):
        raise ValueError("history must be a list, progress an object")
    job = state.job
    if job is not None:
        texts = (job.model, job.target, job.sha256, job.reason, job.result, job.backend,
                 job.probe)  # fmt: skip
        counts = (job.version, job.length, job.unpacked, job.previous, job.load_attempts)
        if not all(isinstance(t, str) for t in texts) or not all(_int(n) for n in counts):
            raise ValueError("job: wrong field types")
        objects = (job.entries, job.probation, job.delta, job.download, job.shadow)
        if not all(isinstance(o, dict) for o in objects):
            raise ValueError("job: entries, probation, delta, download, shadow must be objects")
        if not isinstance(job.window_opens, (int, float)) or isinstance(job.window_opens, bool):
            raise ValueError("job: window_opens must be a number")
        if not _ints(job.tested_counts):
            raise ValueError("job: tested_counts must be a list of integers")


class StateFile:
    """``<state_dir>/state.json`` (and ``state.json.prev``); :meth:`save` is atomic."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.path = state_dir / "state.json"
        self.prev = state_dir / "state.json.prev"
        self.note = ""  # what the last load recovered from, for the log and `ota status`
        self._seen: tuple[int, int, int] | None = None  # state.json as last read or written

    def _read(self, path: Path) -> AgentState | str:
        """The state in ``path``, or why it cannot be used."""
        try:
            return AgentState.from_json(json.loads(path.read_bytes()))
        except FileNotFoundError:
            return "missing"
        except (OSError, ValueError, RecursionError) as exc:  # JSON errors are ValueErrors
            return f"unreadable ({type(exc).__name__}: {exc})"

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def changed(self) -> bool:
        """Whether ``state.json`` was replaced since this object last read or wrote it
        (by another agent, which the lock serialises with this one)."""
        return self._identity() != self._seen

    def load(self) -> AgentState | None:
        """The saved state; a fresh one when there was never any; ``None`` when neither
        file is usable (the caller rebuilds). :attr:`note` says what happened."""
        self.note = ""
        self._seen = self._identity()
        first = self._read(self.path)
        if isinstance(first, AgentState):
            return first
        second = self._read(self.prev)
        if first == "missing" and second == "missing":
            return AgentState()
        if isinstance(second, AgentState):
            self.note = f"{self.path} is {first}: resumed from {self.prev.name}"
            return second
        self.note = (
            f"{self.path} is {first} and {self.prev.name} is {second}: "
            "the state is rebuilt from the model repository"
        )
        return None

    def save(self, state: AgentState) -> None:
        """Replace the state file; Transient (nothing replaced) when it cannot be
        written, e.g. on a full disk."""
        data = json.dumps(state.to_json(), indent=1, sort_keys=True).encode()
        tmp = self.dir / ".state.json.tmp"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if self.path.exists():
                link = self.dir / ".state.json.prev.tmp"
                link.unlink(missing_ok=True)
                os.link(self.path, link)
                os.replace(link, self.prev)
            os.replace(tmp, self.path)
            fsync_dir(self.dir)
            self._seen = self._identity()
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            reason = exc.strerror or str(exc)
            raise Transient(f"cannot save the agent's state in {self.dir}: {reason}") from None


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StateLock:
    """An exclusive, non-blocking lock on the state folder, held for one cycle."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.path = state_dir / "lock"

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """OtaError naming the other agent's pid when it holds the lock."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise Transient(f"cannot open the lock {self.path}: {exc.strerror}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise Transient(f"cannot lock {self.path}: {exc.strerror}") from None
                other = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
                raise OtaError(
                    f"another update agent (pid {other}) is working on {self.dir}; "
                    "not starting a second one"
                ) from None
            with contextlib.suppress(OSError):  # who holds it, for the message above
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the lock
