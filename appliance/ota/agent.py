"""The update agent: one persisted state machine per device, one cycle at a time.

idle -> check -> download -> verify -> waiting -> stage -> load -> self_test ->
shadow -> switch -> probation -> commit, or -> rollback from any step after stage
(the switch promotes the copy the load step built and the self-test tried).
``waiting`` holds a verified download until a maintenance window opens
(:mod:`appliance.ota.window`); ``shadow`` mirrors live traffic to the candidate when its
bundle asks for it (:mod:`appliance.ota.shadow`). The steps live in
:mod:`.fetching`, :mod:`.trial` and :mod:`.commit`; this module runs a
cycle and decides what each outcome means:

- Every cycle runs under the state folder's lock, first makes disk and server agree
  with the state (:func:`appliance.ota.commit.converge`), then checks the clock
  (:mod:`appliance.ota.clock`), then either takes a new job or resumes the one under way.
- Before resuming a job and before every phase change into stage, load, switch and
  commit, fresh verified metadata must still offer the job
  (:func:`appliance.ota.check.still_wanted`): a halted rollout, a removed target or a newer
  version withdraws it (undone if it touched the device; never marked bad).
- Transient failures (repository unreachable, disk full, a mirror too slow, the
  server not reachable: a request that never reached it) keep the job and back
  off: the n-th such cycle in a row waits 2**(n-1) check intervals, at most 16.
- Anything else a candidate does wrong marks its version bad: a refusal before
  stage drops the job, after stage it is rolled back. An unexpected error (a
  library's RecursionError, MemoryError, ...) counts the same, so a hostile bundle
  is given up after one failure, not retried forever; and a phase the agent keeps
  dying in (entered :data:`MAX_ENTRIES` times) is a failure too.
"""

from __future__ import annotations

import logging
import random
import shutil
import threading
import time
from collections.abc import Callable

from appliance.ota import (
    OtaError,
    Rollback,
    Transient,
    Withdrawn,
    abinstall,
    check,
    clock,
    commit,
    download,
    faults,
    fetching,
    install,
    selfupdate,
    space,
    trial,
)
from appliance.ota.config import OtaConfig
from appliance.ota.context import Context, Hook
from appliance.ota.server_api import ServerGone, ServerUnreachable
from appliance.ota.state import AgentState, Job, StateLock

log = logging.getLogger(__name__)

_IDLE_BEAT_S = 10.0  # while waiting for the next check, the agent says it is alive this often
MAX_ENTRIES = 3  # times a phase may be entered before the version is given up
MAX_BACKOFF = 16  # check intervals
GATED = ("stage", "load", "switch", "commit")
RESUMABLE = ("download", "waiting", "load")  # phases entered again and again, by design
SERVER_PHASES = ("load", "self_test", "shadow", "switch", "probation", "commit")
Step = Callable[[Context, Job], str]


class Agent:
    def __init__(self, config: OtaConfig, hook: Hook | None = None) -> None:
        self.cfg = config
        self.ctx = Context(config, hook)
        self.lock = StateLock(config.state_dir)
        self.software_updated = False  # a software update committed: time to make way
        self._load_state()
        self.steps: dict[str, Step] = {
            "download": fetching.download_step,
            "verify": fetching.verify_step,
            "waiting": fetching.waiting_step,
            "stage": fetching.stage_step,
            "load": trial.load_step,
            "self_test": trial.self_test_step,
            "shadow": trial.shadow_step,
            "switch": trial.switch_step,
            "probation": trial.probation_step,
            "commit": commit.commit_step,
            "rollback": commit.rollback_step,
        }

    @property
    def state(self) -> AgentState:
        return self.ctx.state

    @property
    def hook(self) -> Hook | None:
        return self.ctx.hook

    @hook.setter
    def hook(self, value: Hook | None) -> None:
        self.ctx.hook = value

    @property
    def alive_at(self) -> float:
        return self.ctx.alive_at

    def close(self) -> None:
        self.ctx.close()

    def _load_state(self) -> None:
        loaded = self.ctx.store.load()
        note = self.ctx.store.note
        if loaded is None:
            loaded = commit.rebuild(self.cfg)
        if note:
            log.warning("ota: %s", note)
            loaded.last_error = note
        self.ctx.state = loaded

    # ---- the cycle --------------------------------------------------------------------

    def run_once(self) -> bool:
        """One check-and-apply cycle (or the rest of an interrupted one), under the state
        folder's lock. True when it ended without an error (nothing to do counts as
        success). OtaError when another agent holds the lock."""
        with self.lock.held():
            if self.ctx.store.changed():  # another agent worked meanwhile
                self._load_state()
            ok = False
            try:
                ok = self._cycle()
            except Transient as exc:
                self._transient(str(exc))
            finally:
                self._schedule(ok)
            return ok

    def _cycle(self) -> bool:
        ctx, state = self.ctx, self.ctx.state
        try:
            commit.converge(ctx)
            if abinstall.converge(self.cfg):  # a software job a crash interrupted
                ctx.report()
        except OSError as exc:
            raise Transient(f"cannot repair the model repository: {exc}") from None
        now = time.time()
        reason = clock.behind(state.clock_floor, now)
        if reason:
            state.last_error = reason
            ctx.save()
            log.error("ota: %s", reason)
            return False
        job = state.job
        if job is None:
            ctx.enter("check")
            try:
                fresh = check.refresh(self.cfg)
                state.clock_floor = clock.vouched(state.clock_floor, now, fresh.timestamp_expires)
                job = self._take(fresh)
            except OtaError as exc:  # nothing changed: report and wait for the next
                log.error("ota: check: %s", exc)
                state.last_error = str(exc)
                if isinstance(exc, Transient):
                    state.retries += 1
                ctx.enter("idle")
                ctx.report("error")
                return False
            state.last_check, state.retries = time.time(), 0
            if job is None:
                state.last_error = ""
                ctx.enter("idle")
                return self._software(fresh)
            state.job = job
            ctx.enter("download")
        elif not job.committed and state.phase != "rollback":
            phase = state.phase if state.phase in self.steps else "download"
            job.entries[phase] = job.entries.get(phase, 0) + 1
            ctx.save()
            try:
                if phase not in RESUMABLE and job.entries[phase] > MAX_ENTRIES:
                    raise OtaError(
                        f"the agent was interrupted {job.entries[phase] - 1} times during "
                        f"{phase}: giving this version up"
                    )
                self._gate(job)
            except Exception as exc:
                return self._failed(job, phase, exc)
        return self._drive()

    def _take(self, fresh: check.Fresh) -> Job | None:
        offer = check.newest_offer(self.cfg, self.ctx.state, fresh)
        if offer is None:
            return None
        check.fits_budget(self.cfg, self.ctx.api, offer)
        previous = check.current(self.cfg, self.ctx.state, offer.model)
        ms = self.ctx.state.model(offer.model)
        if offer.version in ms.bad:  # the fleet asked the devices that failed to retry
            info = offer.target.custom.get("appliance", {})
            ms.retried[str(offer.version)] = int(info.get("rollout", {}).get("retry", 0))
            ms.bad.remove(offer.version)
            log.info("ota: %s version %d failed here before; the fleet asks for a retry",
                     offer.model, offer.version)  # fmt: skip
        return Job(
            model=offer.model,
            version=offer.version,
            target=offer.target.path,
            length=offer.target.length,
            sha256=offer.target.hashes.get("sha256", ""),
            unpacked=offer.unpacked_bytes,
            backend=check.signed_backend(fresh, offer.target.path),
            previous=previous,
            started=time.time(),
            delta=check.delta_for(fresh, offer, previous),
        )

    def _software(self, fresh: check.Fresh) -> bool:
        """With no model job: the newest software release, installed A/B."""
        try:
            result = selfupdate.run(self.ctx, fresh)
        except download.Dropped as exc:
            return self._transient(str(exc))
        except Transient as exc:
            return self._transient(str(exc))
        except OtaError as exc:
            log.error("ota: software refused: %s", exc)
            self.ctx.state.last_error = str(exc)
            self.ctx.report("refused")
            return False
        if result:
            self.ctx.report(result)
        # a new agent runs from ``current`` now: the service exits so its unit starts it
        self.software_updated = self.software_updated or result == "updated"
        return result in ("", "updated", "withdrawn")

    def _gate(self, job: Job) -> None:
        """Withdrawn unless fresh verified metadata still offers ``job``."""
        fresh = check.refresh(self.cfg)
        state = self.ctx.state
        state.clock_floor = clock.vouched(state.clock_floor, time.time(), fresh.timestamp_expires)
        reason = check.still_wanted(self.cfg, state, job, fresh)
        if reason:
            raise Withdrawn(reason)

    def _drive(self) -> bool:
        while (job := self.ctx.state.job) is not None:
            phase = self.ctx.state.phase
            if phase not in self.steps:  # "check" or "idle" with a job: it never started
                phase = "download"
            try:
                faults.point(f"step:{phase}")
                nxt = self.steps[phase](self.ctx, job)
                if nxt == "idle":
                    return self.ctx.state.last_error == ""
                if nxt in GATED and not job.committed:
                    self._gate(job)
            except Exception as exc:
                return self._failed(job, phase, exc)
            self.ctx.enter(nxt)  # a state that cannot be saved ends the cycle (Transient)
        return True

    # ---- outcomes -----------------------------------------------------------------------

    def _failed(self, job: Job, phase: str, exc: Exception) -> bool:
        """What a step's exception means for the job; the cycle's result."""
        touched = phase in commit.TOUCHING
        if isinstance(exc, Withdrawn):
            log.warning("ota: %s version %d withdrawn: %s", job.model, job.version, exc)
            if touched:
                self._roll_back(job, str(exc), bad=False, result="withdrawn")
            else:
                commit.finish(self.ctx, job, "withdrawn", reason=str(exc))
            return self.ctx.state.job is None
        if isinstance(exc, Rollback):
            return self._roll_back(job, str(exc))
        if isinstance(exc, ServerUnreachable):  # not the candidate's doing: wait for it
            return self._transient(f"{phase} of {job.model} version {job.version}: {exc}")
        if isinstance(exc, ServerGone):
            if phase in SERVER_PHASES and not job.committed:
                return self._roll_back(job, f"the server stopped during {phase}: {exc}")
            return self._transient(str(exc))
        if isinstance(exc, download.Dropped):  # a deadline: start over later
            commit.finish(self.ctx, job, "refused", str(exc))
            return False
        if isinstance(exc, OSError):
            return self._disk_error(job, phase, exc)
        if isinstance(exc, Transient) or (isinstance(exc, OtaError) and phase == "download"):
            return self._transient(str(exc))
        if phase == "rollback" or job.committed:  # redone from the state at the next cycle
            return self._transient(f"{phase}: {exc}")
        reason = str(exc) if isinstance(exc, OtaError) else f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, OtaError):
            log.debug("ota: unexpected error during %s", phase, exc_info=exc)
        if touched:
            return self._roll_back(job, reason)
        log.error("ota: %s version %d refused: %s", job.model, job.version, reason)
        ms = self.ctx.state.model(job.model)
        if job.version not in ms.bad:
            ms.bad.append(job.version)
        commit.finish(self.ctx, job, "refused", reason)
        return False

    def _roll_back(self, job: Job, reason: str, bad: bool = True, result: str = "") -> bool:
        job.reason, job.bad, job.result = reason, bad, result or "rolled_back"
        try:
            self.ctx.enter("rollback")
            commit.rollback_step(self.ctx, job)
        except Exception as exc:  # the state says rollback: the next cycle finishes it
            self._transient(f"rollback of {job.model} version {job.version}: {exc}")
        return False

    def _disk_error(self, job: Job, phase: str, exc: OSError) -> bool:
        """A write that failed (a full disk, most often): partial files removed, the
        job kept, tried again once there is room."""
        repo = self.cfg.model_repository
        if phase in ("download", "verify", "stage"):
            shutil.rmtree(install.staging_dir(repo, job.model, job.version), ignore_errors=True)
        if phase == "download" and space.is_full(exc):
            (self.ctx.downloads / f"{job.sha256}.part").unlink(missing_ok=True)
        what = "the disk is full" if space.is_full(exc) else "a file operation failed"
        return self._transient(f"{phase} of {job.model} version {job.version}: {what}: {exc}")

    def _transient(self, reason: str) -> bool:
        state = self.ctx.state
        state.last_error, state.retries = reason, state.retries + 1
        if state.job is not None:  # it left this phase cleanly: not a crash to count
            state.job.entries.pop(state.phase, None)
        log.error("ota: %s", reason)
        self._try_save()  # the disk may be full: the report still goes out
        self.ctx.report("error")
        return False

    def _try_save(self) -> None:
        try:
            self.ctx.save()
        except Transient as exc:
            if str(exc) != self.ctx.state.last_error:  # said once a cycle, not three times
                log.error("ota: %s", exc)

    def _schedule(self, ok: bool) -> None:
        state, interval = self.ctx.state, self.cfg.check_interval_s
        if ok:
            state.retries = 0
        if state.retries:
            interval *= min(2 ** (state.retries - 1), MAX_BACKOFF)
        spread = interval * self.cfg.jitter
        state.next_check = time.time() + max(0.0, interval + random.uniform(-spread, spread))
        job = state.job
        if job is not None and state.phase == "waiting" and job.window_opens:
            state.next_check = min(state.next_check, job.window_opens + 1.0)
        self._try_save()

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except Exception as exc:  # another agent's lock; or anything, unattended for months
                log.error("ota: %s", exc if isinstance(exc, OtaError) else repr(exc))
                log.debug("ota: cycle failed", exc_info=exc)
                self.ctx.state.next_check = time.time() + self.cfg.check_interval_s  # no busy loop
            if self.software_updated:
                log.info("ota: software updated: exiting, so the new agent takes over")
                return
            state = self.ctx.state
            while not stop.wait(min(_IDLE_BEAT_S, max(0.0, state.next_check - time.time()))):
                self.ctx.alive_at = time.monotonic()  # idle, and alive
                if time.time() >= state.next_check:
                    break
