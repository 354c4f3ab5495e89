"""Trying the candidate on the running server: the load, self-test, switch and
probation steps.

- load: first waits for the server to answer (``server_wait_s``, with back-off: at
  boot the agent may start before the server), then a repository load with a
  config override naming the committed and the new version, ``default_version``
  the committed one: the new version is addressable by version while unversioned
  traffic stays where it was. A load interrupted ``max_load_attempts`` times
  (server crash, power cut) marks the version bad; a server that cannot be reached
  never does (the agent keeps the job and tries again later).
- self_test: the bundle's vectors against the new version, by version; a bundle
  without vectors gets one probe generated from its config (:mod:`appliance.ota.probes`).
- shadow: when the bundle's manifest carries a shadow policy and a version serves,
  a sample of live traffic mirrored to the candidate and its outputs judged against
  the serving version's (:mod:`appliance.ota.shadow`); the summary goes to the fleet.
- switch: a load naming only the new version: the server keeps (promotes) the copy
  it tested, and the old version drains.
- probation: the new version's statistics counted after its self-test (kept in the
  job: the promoted copy's counters hold the self-test's requests) and the agent's
  own probes (the bundle's vectors, else generated ones: an idle device has nothing
  else to count), judged by :mod:`appliance.ota.probation`; the job says which probes ran.

Each step first checks that the server still holds what the previous steps left
there. A server that restarted meanwhile (a power cut, or a crash) loaded the
committed config from disk and holds only the committed version: the step then
goes back to ``load`` (which counts the attempt), so the candidate is tested again
from the start and never committed on a server that no longer runs it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from appliance.ota import OtaError, Rollback, bundle, install, probation, probes, selftest, shadow
from appliance.ota.context import Context, log
from appliance.ota.server_api import ServerGone, VersionStats
from appliance.ota.state import Job


def _candidate_lost(ctx: Context, job: Job) -> bool:
    """Whether the server no longer has the new version loaded (it restarted)."""
    if job.version in ctx.api.ready_versions(job.model):
        return False
    log.warning(
        "ota: %s version %d is no longer loaded (the server restarted?): loading it again",
        job.model, job.version,
    )  # fmt: skip
    return True


def load_step(ctx: Context, job: Job) -> str:
    ctx.api.wait_live(ctx.cfg.server_wait_s, ctx.mark_alive)  # not an attempt yet
    job.load_attempts += 1
    ctx.save()
    if job.load_attempts > ctx.cfg.max_load_attempts:
        raise Rollback(
            f"loading version {job.version} was interrupted {job.load_attempts - 1} "
            f"time(s) (server crash or power loss): not loading it again"
        )
    config = ctx.candidate_config(job)
    versions = [job.previous, job.version] if job.previous else [job.version]
    try:
        ctx.api.load(job.model, install.with_versions(config, versions), job.previous)
    except ServerGone:
        raise
    except OtaError as exc:
        raise Rollback(f"the server refused to load version {job.version}: {exc}") from None
    return "self_test"


def _vectors(ctx: Context, job: Job) -> tuple[dict[str, Any], ...]:
    return bundle.first_manifest(ctx.bundle_path(job)).self_test


def _probe_kind(ctx: Context, job: Job, vectors: tuple[dict[str, Any], ...]) -> str:
    """``vectors``, ``generated`` (from the candidate's config), or ``none: <why>``."""
    if vectors:
        return "vectors"
    _, why = probes.inputs_of(ctx.candidate_config(job))
    return f"none: {why}" if why else "generated"


def self_test_step(ctx: Context, job: Job) -> str:
    if _candidate_lost(ctx, job):
        return "load"
    vectors = _vectors(ctx, job)
    job.probe = _probe_kind(ctx, job, vectors)
    try:
        if job.probe == "generated":
            probes.check(ctx.api, job.model, job.version, ctx.candidate_config(job), 0,
                         ctx.cfg.probe_timeout_s)  # fmt: skip
            count = 1
        else:
            count = selftest.run(ctx.api, job.model, job.version, vectors)
    except ServerGone:
        raise
    except OtaError as exc:
        raise Rollback(f"self-test failed: {exc}") from None
    log.info("ota: %s version %d passed %d self-test probe(s) (%s)", job.model, job.version,
             count, job.probe)  # fmt: skip
    stats = _stats(ctx, job.model)
    before = stats.get(job.previous)
    job.old_latency_us = int(before.mean_ms() * 1000) if before else 0
    _tested(job, stats)
    return "shadow"


def _tested(job: Job, stats: dict[int, VersionStats]) -> None:
    """Probation counts from here on (the switch promotes this very copy)."""
    tested = stats.get(job.version)
    job.tested_counts = tested.counts() if tested else []


def shadow_step(ctx: Context, job: Job) -> str:
    if _candidate_lost(ctx, job):
        return "load"
    policy = shadow.parse(bundle.first_manifest(ctx.bundle_path(job)).shadow)
    if policy is None:
        return "switch"
    if not job.previous:
        job.shadow = {"verdict": "skipped: no version serves to compare with (a fresh install)"}
        return "switch"

    def alive() -> None:
        ctx.alive_at = time.monotonic()

    try:
        verdict, job.shadow = shadow.run(
            ctx.api, job.model, job.version, policy, ctx.cfg.probation_poll_s, alive
        )
    except ServerGone:
        raise
    except OtaError as exc:
        raise Rollback(f"shadow probation could not run: {exc}") from None
    ctx.save()
    if verdict:
        raise Rollback(f"shadow probation: {verdict}")
    log.info("ota: %s version %d passed shadow probation: %s", job.model, job.version,
             job.shadow)  # fmt: skip
    _tested(job, _stats(ctx, job.model))  # the mirrored requests reached this copy too
    return "switch"


def _stats(ctx: Context, model: str) -> dict[int, VersionStats]:
    """Each version's statistics, with the caller's faults from the metrics page (all
    failures count as the model's when the page is off)."""
    stats = ctx.api.stats(model)
    clients = ctx.api.client_errors(model) or {}
    return {v: dataclasses.replace(s, client_errors=clients.get(v, 0)) for v, s in stats.items()}


def switch_step(ctx: Context, job: Job) -> str:
    if _candidate_lost(ctx, job):
        return "load"
    config = ctx.candidate_config(job)
    try:
        ctx.api.load(job.model, install.with_versions(config, [job.version]))
    except ServerGone:
        raise
    except OtaError as exc:
        raise Rollback(f"the switch to version {job.version} failed: {exc}") from None
    return "probation"


def _probe(ctx: Context, job: Job, vectors: tuple[dict[str, Any], ...], n: int) -> bool:
    """One probe (vector ``n`` modulo their count, or generated probe ``n``); False
    when it went unanswered in time or answered wrong. ServerGone when the server
    itself is gone."""
    timeout_s = ctx.cfg.probe_timeout_s
    try:
        if vectors:
            selftest.check(ctx.api, job.model, job.version, n, vectors[n % len(vectors)], timeout_s)
        else:
            probes.check(ctx.api, job.model, job.version, ctx.candidate_config(job), n, timeout_s)
    except ServerGone:
        if not ctx.api.live():
            raise
        log.warning("ota: probation probe %d unanswered within %gs", n, timeout_s)
        return False
    except OtaError as exc:
        log.warning("ota: probation probe %d failed: %s", n, exc)
        return False
    return True


def probation_step(ctx: Context, job: Job) -> str:
    if _candidate_lost(ctx, job):
        return "load"
    cfg = ctx.cfg
    vectors = _vectors(ctx, job)
    if not job.probe:  # a job from before probes were generated
        job.probe = _probe_kind(ctx, job, vectors)
    counts = probation.Counts()
    # the switch promoted the tested copy: its counters hold the self-test's requests
    tested = VersionStats(*job.tested_counts) if len(job.tested_counts) == 4 else None
    deadline = time.monotonic() + cfg.probation_s
    while True:
        if job.probe in ("vectors", "generated"):
            counts.probe_failures += not _probe(ctx, job, vectors, counts.probes)
            counts.probes += 1
        now = _stats(ctx, job.model).get(job.version)
        if now is None:
            raise Rollback(f"version {job.version} is no longer loaded during probation")
        stats = now.since(tested)
        counts.success, counts.model_failures = stats.success, stats.model_failures
        counts.client_errors, counts.mean_ms = stats.client_errors, stats.mean_ms()
        counts.split = int(ctx.cfg.metrics_url != "")
        job.probation = counts.to_json()
        final = time.monotonic() >= deadline
        verdict = probation.judge(counts, job.old_latency_us / 1000, cfg, final)
        if verdict:
            raise Rollback(f"probation ({job.probe} probes): {verdict}")
        if final:
            log.info("ota: %s version %d passed probation (%s probes): %s", job.model,
                     job.version, job.probe, counts.summary())  # fmt: skip
            return "commit"
        ctx.alive_at = time.monotonic()
        time.sleep(min(cfg.probation_poll_s, max(0.0, deadline - time.monotonic())))
