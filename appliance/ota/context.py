"""What every step of the agent works with: its config, state, the server, reports.

A :class:`Context` holds the persisted state and the handles to the outside (the
server's HTTP API, the download pool, the MQTT reporter) and owns the two things
every step does the same way: saving the state before acting (:meth:`save`,
:meth:`enter`) and reporting it to the fleet (:meth:`report`). The steps
(:mod:`.fetching`, :mod:`.trial`, :mod:`.commit`) are functions of a
context and the job; :mod:`appliance.ota.agent` runs them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import urllib3

from appliance.ota import OtaError, devicekey, faults, install, report
from appliance.ota.config import OtaConfig
from appliance.ota.report import Reporter
from appliance.ota.server_api import ServerApi
from appliance.ota.state import AgentState, Job, StateFile

log = logging.getLogger("appliance.ota.agent")

Hook = Callable[[str], None]  # called on entering each phase, after it is saved


class Context:
    def __init__(self, config: OtaConfig, hook: Hook | None = None) -> None:
        self.cfg = config
        self.store = StateFile(config.state_dir)
        self.state = AgentState()
        self.api = ServerApi(
            config.server, config.admin_token, config.request_timeout_s, config.metrics_url
        )
        self.http = urllib3.PoolManager(maxsize=2)
        self.hook = hook
        self.reporter: Reporter | None = None
        if config.mqtt is not None:
            try:
                key = devicekey.load(config.state_dir)
            except (OtaError, OSError) as exc:  # reports go out unsigned, and say why
                log.error("ota: reports are not signed: %s", exc)
                key = None
            self.reporter = Reporter(config.mqtt, config.device_id, key)
        self._last_progress_save = 0.0
        # when the agent last showed it is alive: a systemd watchdog pings only while
        # this is recent, so a hung agent gets restarted (see appliance/ota/commands.py)
        self.alive_at = time.monotonic()

    # ---- persistence and reporting ------------------------------------------------------

    def mark_alive(self) -> None:
        """Progress, as far as the watchdog is concerned (a wait that is meant)."""
        self.alive_at = time.monotonic()

    def save(self) -> None:
        self.store.save(self.state)
        self.alive_at = time.monotonic()

    def enter(self, phase: str) -> None:
        """Save ``phase`` as the step under way, then report it (save before acting)."""
        self.state.phase = phase
        job = self.state.job
        if job is not None and phase != "idle":
            job.entries[phase] = job.entries.get(phase, 0) + 1
        self.save()
        log.info("ota: %s%s", phase, self.job_text())
        faults.point(f"phase:{phase}")
        self.report()
        if self.hook is not None:
            self.hook(phase)

    def job_text(self) -> str:
        job = self.state.job
        return f" {job.model} version {job.version}" if job else ""

    def report(self, result: str = "") -> None:
        if self.reporter is not None:
            sw = report.software_of(self.cfg.state_dir / "software")
            self.reporter.publish(report.payload(self.cfg.device_id, self.state, result, sw))

    def progress(self, done: int, total: int) -> None:
        self.state.progress = {"bytes": done, "total": total}
        if time.monotonic() - self._last_progress_save > 1.0 or done == total:
            self._last_progress_save = time.monotonic()
            self.save()

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()

    # ---- the job's files ------------------------------------------------------------------

    @property
    def downloads(self) -> Path:
        return self.cfg.state_dir / "downloads"

    def bundle_path(self, job: Job) -> Path:
        return self.downloads / f"{job.sha256}.bundle"

    def remove_download(self, job: Job) -> None:
        """The job's files in the downloads folder: the bundle's and its delta's."""
        for digest in (job.sha256, str(job.delta.get("sha256", ""))):
            if digest:
                self.remove_files(digest)

    def remove_files(self, sha256: str) -> None:
        """A download's files (finished or partial), named by their sha256."""
        for suffix in ("bundle", "part"):
            (self.downloads / f"{sha256}.{suffix}").unlink(missing_ok=True)

    def candidate_path(self, job: Job) -> Path:
        """The candidate's config (Triton JSON), kept from stage until the commit wrote
        it to the model repository."""
        return self.cfg.state_dir / "candidates" / f"{job.model}-{job.version}.json"

    def save_candidate_config(self, job: Job, config: dict[str, Any]) -> None:
        path = self.candidate_path(job)
        path.parent.mkdir(parents=True, exist_ok=True)
        install.write_json(path, config)

    def candidate_config(self, job: Job) -> dict[str, Any]:
        return install.read_json(self.candidate_path(job))
