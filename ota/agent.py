"""The update agent: one persisted state machine per device.

idle -> check -> download -> verify -> stage -> load -> self_test -> switch ->
probation -> commit, or -> rollback from any step after stage. Each step is saved
(:mod:`ota.state`) before it acts and is safe to redo, so an agent restarted after
a crash or power cut continues where it stopped:

- check: refresh TUF metadata (ngclient: signatures, versions, expiry, rollback
  and mix-and-match checks) and pick, per model, the newest bundle whose rollout
  includes this device, that is not marked bad, fits this machine and the memory
  budget. Skipping versions is normal: a device offline for a week goes straight
  to the newest.
- download / verify: resumable download checked against the signed length and
  hashes, then the bundle's manifest and every member (:mod:`ota.bundle`).
- stage: extract to a hidden folder, rename it to ``<model>/<version>``. The
  config on disk keeps naming only the committed version (:mod:`ota.install`).
- load: a config override names old and new version, with ``default_version``
  the old one, so the old one keeps the unversioned traffic. A load interrupted
  ``max_load_attempts`` times (server crash, power cut) marks the version bad.
- self_test: the bundle's vectors against the new version, by version.
- switch: a load naming only the new version: the server keeps (promotes) the
  copy it tested, and the old version drains.
- probation: the new version's error rate and latency from the statistics, counted
  after its self-test.
- commit: the config on disk names the new version; old folders beyond
  ``keep_versions`` are removed. rollback: the committed config is loaded again,
  the candidate folder removed and the version marked bad.
"""

from __future__ import annotations

import logging
import random
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import urllib3
from tuf.api.metadata import TargetFile

from ota import OtaError, bundle, check, download, install, probation, report, selftest
from ota.config import OtaConfig
from ota.manifest import Manifest
from ota.report import Reporter
from ota.server_api import ServerApi, ServerGone, VersionStats
from ota.state import Job, StateFile

log = logging.getLogger(__name__)

Hook = Callable[[str], None]  # called on entering each phase, after it is saved
CLOCK_SLACK_S = 300.0
_IDLE_BEAT_S = 10.0  # while waiting for the next check, the agent says it is alive this often


class Rollback(OtaError):
    """The candidate failed after it touched the device: undo and mark it bad."""


class Agent:
    def __init__(self, config: OtaConfig, hook: Hook | None = None) -> None:
        self.cfg = config
        self.store = StateFile(config.state_dir)
        self.state = self.store.load()
        self.api = ServerApi(config.server, config.admin_token, config.request_timeout_s)
        self.http = urllib3.PoolManager(maxsize=2)
        self.hook = hook
        self.reporter = Reporter(config.mqtt, config.device_id) if config.mqtt else None
        self._last_progress_save = 0.0
        # when the agent last showed it is alive: a systemd watchdog pings only while
        # this is recent, so a hung agent gets restarted (see ota/commands.py)
        self.alive_at = time.monotonic()

    # ---- persistence and reporting --------------------------------------------------

    def _save(self) -> None:
        self.store.save(self.state)
        self.alive_at = time.monotonic()

    def _enter(self, phase: str) -> None:
        self.state.phase = phase
        self._save()
        log.info("ota: %s%s", phase, self._job_text())
        self._report()
        if self.hook is not None:
            self.hook(phase)

    def _job_text(self) -> str:
        job = self.state.job
        return f" {job.model} version {job.version}" if job else ""

    def _report(self, result: str = "") -> None:
        if self.reporter is not None:
            self.reporter.publish(report.payload(self.cfg.device_id, self.state, result))

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()

    # ---- the cycle --------------------------------------------------------------------

    def run_once(self) -> bool:
        """One check-and-apply cycle (or the rest of an interrupted one). True when it
        ended without an error (nothing to do counts as success)."""
        now = time.time()
        if now < self.state.clock_floor - CLOCK_SLACK_S:
            self.state.last_error = (
                "the clock is behind the last time this device saw; waiting for it to "
                "be set (NTP) before trusting metadata expiry"
            )
            self._save()
            log.error("ota: %s", self.state.last_error)
            return False
        self.state.clock_floor = max(self.state.clock_floor, now)
        try:
            if self.state.job is None:
                self._enter("check")
                try:
                    job = self._check()
                except OtaError as exc:  # nothing changed: report and wait for the next
                    self.state.last_error = str(exc)
                    log.error("ota: check: %s", exc)
                    self._enter("idle")
                    self._report("error")
                    return False
                self.state.last_check = time.time()
                if job is None:
                    self.state.last_error = ""
                    self._enter("idle")
                    return True
                self.state.job = job
                self._enter("download")
            return self._drive()
        finally:
            self._schedule()

    def _schedule(self) -> None:
        spread = self.cfg.check_interval_s * self.cfg.jitter
        wait = self.cfg.check_interval_s + random.uniform(-spread, spread)
        self.state.next_check = time.time() + max(0.0, wait)
        self._save()

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except OtaError as exc:
                log.error("ota: %s", exc)
            while not stop.wait(min(_IDLE_BEAT_S, max(0.0, self.state.next_check - time.time()))):
                self.alive_at = time.monotonic()  # idle, and alive
                if time.time() >= self.state.next_check:
                    break

    def _drive(self) -> bool:
        steps: dict[str, Callable[[Job], str]] = {
            "download": self._download,
            "verify": self._verify,
            "stage": self._stage,
            "load": self._load,
            "self_test": self._self_test,
            "switch": self._switch,
            "probation": self._probation,
            "commit": self._commit,
            "rollback": self._rollback,
        }
        while self.state.job is not None:
            job, phase = self.state.job, self.state.phase
            if phase not in steps:  # "check" or "idle" with a job: it never started
                phase = "download"
            try:
                nxt = steps[phase](job)
            except Rollback as exc:
                return self._fail(job, str(exc), rollback=True, bad=True)
            except ServerGone as exc:
                if phase in ("load", "self_test", "switch", "probation"):
                    reason = f"the server stopped during {phase}: {exc}"
                    return self._fail(job, reason, rollback=True, bad=True)
                return self._fail(job, str(exc), rollback=False, bad=False)
            except download.Mismatch as exc:  # a bad mirror: drop the job, retry next check
                return self._fail(job, str(exc), rollback=False, bad=False)
            except OtaError as exc:
                if phase == "download":  # keep the job: the next cycle resumes it
                    self.state.last_error = str(exc)
                    self._save()
                    log.error("ota: %s", exc)
                    self._report("error")
                    return False
                after_stage = phase not in ("verify",)
                return self._fail(job, str(exc), rollback=after_stage, bad=True)
            if nxt == "idle":
                return self.state.last_error == ""
            self._enter(nxt)
        return True

    def _fail(self, job: Job, reason: str, rollback: bool, bad: bool) -> bool:
        log.error("ota: %s version %d refused: %s", job.model, job.version, reason)
        job.reason = reason
        if rollback:
            self._enter("rollback")
            self._rollback(job)
        else:
            if bad:
                self.state.model(job.model).bad.append(job.version)
            self._finish(job, "refused", reason)
        return False

    def _finish(self, job: Job, result: str, error: str = "") -> None:
        self._remove_download(job)
        self.state.history = [
            *self.state.history[-9:],
            {"model": job.model, "version": job.version, "result": result, "error": error,
             "time": time.time()},
        ]  # fmt: skip
        self.state.job, self.state.last_error, self.state.progress = None, error, {}
        self.state.phase = "idle"
        self._save()
        self._report(result)

    # ---- check ------------------------------------------------------------------------

    def _check(self) -> Job | None:
        offer = check.newest_offer(self.cfg, self.state)
        if offer is None:
            return None
        check.fits_budget(self.cfg, self.api, offer)
        return Job(
            model=offer.model,
            version=offer.version,
            target=offer.target.path,
            length=offer.target.length,
            sha256=offer.target.hashes.get("sha256", ""),
            previous=check.current(self.cfg, self.state, offer.model),
            started=time.time(),
        )

    # ---- download, verify, stage --------------------------------------------------------

    def _bundle_path(self, job: Job) -> Any:
        return self.cfg.state_dir / "downloads" / f"{job.sha256}.bundle"

    def _remove_download(self, job: Job) -> None:
        for suffix in ("bundle", "part"):
            (self.cfg.state_dir / "downloads" / f"{job.sha256}.{suffix}").unlink(missing_ok=True)

    def _progress(self, done: int, total: int) -> None:
        self.state.progress = {"bytes": done, "total": total}
        if time.monotonic() - self._last_progress_save > 1.0 or done == total:
            self._last_progress_save = time.monotonic()
            self._save()

    def _download(self, job: Job) -> str:
        target = TargetFile(job.length, {"sha256": job.sha256}, job.target)
        folder, _, name = job.target.rpartition("/")
        url = f"{self.cfg.source}targets/{folder}/{job.sha256}.{name}"
        download.fetch(
            self.http,
            url,
            target,
            self.cfg.state_dir / "downloads",
            self.cfg.max_bandwidth,
            self._progress,
        )
        return "verify"

    def _manifest(self, job: Job) -> Manifest:
        manifest = bundle.inspect(self._bundle_path(job), self.cfg.max_bundle_bytes)
        if (manifest.name, manifest.version) != (job.model, job.version):
            raise OtaError(
                f"the bundle holds {manifest.name} version {manifest.version}, but the signed "
                f"target says {job.model} version {job.version}"
            )
        if bundle.machine() not in manifest.platforms:
            raise OtaError(f"the bundle is for {manifest.platforms}, not {bundle.machine()}")
        return manifest

    def _verify(self, job: Job) -> str:
        try:
            self._manifest(job)
        except OtaError:
            self._remove_download(job)
            raise
        return "stage"

    def _stage(self, job: Job) -> str:
        repo = self.cfg.model_repository
        if job.previous:  # pin the committed version on disk before the candidate lands
            current = install.on_disk(repo, job.model)
            if current is not None:
                pinned = install.with_versions(current, [job.previous])
                install.write_config(repo, job.model, pinned)
        staging = install.staging_dir(repo, job.model, job.version)
        shutil.rmtree(staging, ignore_errors=True)
        staging.parent.mkdir(parents=True, exist_ok=True)
        manifest, config = bundle.extract(
            self._bundle_path(job), staging, self.cfg.max_bundle_bytes
        )
        canonical = install.canonical(job.model, manifest.config_file, config)
        self._save_candidate_config(job, canonical)
        if not job.previous:  # fresh install: the model's config is the bundle's
            install.write_config(repo, job.model, install.with_versions(canonical, [job.version]))
        install.place(staging, repo, job.model, job.version)
        return "load"

    def _candidate_path(self, job: Job) -> Any:
        return self.cfg.state_dir / "candidates" / f"{job.model}-{job.version}.json"

    def _save_candidate_config(self, job: Job, config: dict[str, Any]) -> None:
        path = self._candidate_path(job)
        path.parent.mkdir(parents=True, exist_ok=True)
        install.write_json(path, config)

    def _candidate_config(self, job: Job) -> dict[str, Any]:
        return install.read_json(self._candidate_path(job))

    # ---- load, self-test, switch, probation ---------------------------------------------

    def _load(self, job: Job) -> str:
        job.load_attempts += 1
        self._save()
        if job.load_attempts > self.cfg.max_load_attempts:
            raise Rollback(
                f"loading version {job.version} was interrupted {job.load_attempts - 1} "
                f"time(s) (server crash or power loss): not loading it again"
            )
        config = self._candidate_config(job)
        versions = [job.previous, job.version] if job.previous else [job.version]
        try:
            self.api.load(job.model, install.with_versions(config, versions), job.previous)
        except ServerGone:
            raise
        except OtaError as exc:
            raise Rollback(f"the server refused to load version {job.version}: {exc}") from None
        return "self_test"

    def _self_test(self, job: Job) -> str:
        manifest = self._manifest(job)
        try:
            count = selftest.run(self.api, job.model, job.version, manifest.self_test)
        except ServerGone:
            raise
        except OtaError as exc:
            raise Rollback(f"self-test failed: {exc}") from None
        log.info("ota: %s version %d passed %d self-test vector(s)", job.model, job.version, count)
        stats = self.api.stats(job.model)
        before = stats.get(job.previous)
        job.old_latency_us = int(before.mean_ms() * 1000) if before else 0
        tested = stats.get(job.version)
        job.tested_counts = [tested.success, tested.fail, tested.success_ns] if tested else []
        return "switch"

    def _switch(self, job: Job) -> str:
        config = self._candidate_config(job)
        try:
            self.api.load(job.model, install.with_versions(config, [job.version]))
        except ServerGone:
            raise
        except OtaError as exc:
            raise Rollback(f"the switch to version {job.version} failed: {exc}") from None
        return "probation"

    def _probation(self, job: Job) -> str:
        deadline = time.monotonic() + self.cfg.probation_s
        # the switch promoted the tested copy: its counters hold the self-test's requests
        tested = VersionStats(*job.tested_counts) if len(job.tested_counts) == 3 else None
        while True:
            now = self.api.stats(job.model).get(job.version)
            if now is None:
                raise Rollback(f"version {job.version} is no longer loaded during probation")
            stats = now.since(tested)
            verdict = probation.judge(stats, job.old_latency_us / 1000, self.cfg)
            if verdict:
                raise Rollback(f"probation: {verdict}")
            if time.monotonic() >= deadline:
                return "commit"
            self.alive_at = time.monotonic()
            time.sleep(min(self.cfg.probation_poll_s, max(0.0, deadline - time.monotonic())))

    # ---- commit and rollback ------------------------------------------------------------

    def _commit(self, job: Job) -> str:
        repo = self.cfg.model_repository
        install.write_config(
            repo, job.model, install.with_versions(self._candidate_config(job), [job.version])
        )
        ms = self.state.model(job.model)
        kept = [v for v in [job.previous, *ms.previous] if v and v != job.version]
        keep = kept[: self.cfg.keep_versions - 1]
        for v in install.disk_versions(repo, job.model):
            if v != job.version and v not in keep:
                install.remove_version(repo, job.model, v)
        ms.current, ms.previous = job.version, keep
        self._candidate_path(job).unlink(missing_ok=True)
        log.info("ota: %s version %d committed", job.model, job.version)
        self._finish(job, "updated")
        return "idle"

    def _rollback(self, job: Job) -> str:
        repo = self.cfg.model_repository
        try:
            if job.previous:
                self.api.load_from_disk(job.model)  # the committed config: old version
            else:
                self.api.unload(job.model)
        except OtaError as exc:  # a server that is down loads the committed config itself
            log.warning("ota: rollback of %s: %s", job.model, exc)
        if job.previous:
            install.remove_version(repo, job.model, job.version)
        else:
            install.remove_model(repo, job.model)
        shutil.rmtree(install.staging_dir(repo, job.model, job.version), ignore_errors=True)
        self._candidate_path(job).unlink(missing_ok=True)
        self.state.model(job.model).bad.append(job.version)
        reason = job.reason or "rolled back"
        log.error("ota: %s version %d rolled back: %s", job.model, job.version, reason)
        self._finish(job, "rolled_back", reason)
        return "idle"
