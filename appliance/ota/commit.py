"""The one truth of a device, and how everything converges on it after a crash.

The truth is the state file's committed version of each model
(``models[m].current``). It changes in exactly one place, the commit's single
atomic state write, which also marks the job ``committed``. Everything else is
derived from it and repaired toward it:

- commit: the server must be serving the candidate (else the step goes back to
  ``load``: a server that restarted holds only the committed version); then the
  state write (the commit point), then the config on disk names the new version,
  the server is made to serve it (loaded from disk if it does not), old version
  folders beyond ``keep_versions`` are removed and the job is finished. Every
  step after the state write is idempotent and is redone after a crash.
- rollback: the committed config is loaded again (or a fresh install unloaded),
  the candidate's files removed, the version marked bad unless the fleet withdrew
  it.
- :func:`converge`, at the start of every cycle: a committed job is finished;
  for every model not in the middle of a job, the config on disk is pinned to the
  committed version and the server is made to serve exactly that version
  (reloaded from disk when it serves anything else). A server that is down is left
  alone: it loads the config on disk when it starts.
- :func:`rebuild`: when the state file and its previous copy are both unusable,
  the committed versions are read back from the configs on disk (the agent pins
  each managed model to one version).
"""

from __future__ import annotations

import shutil
import time

from appliance.ota import OtaError, bundle, faults, install, selftest
from appliance.ota.config import OtaConfig
from appliance.ota.context import Context, log
from appliance.ota.server_api import ServerGone
from appliance.ota.state import AgentState, Job, ModelState

# the phases in which the job's own step decides what disk and server hold
TOUCHING = ("stage", "load", "self_test", "shadow", "switch", "probation", "commit", "rollback")


def finish(ctx: Context, job: Job, result: str, error: str = "", reason: str = "") -> None:
    """Close the job: its download removed, the result kept in the history.
    ``error`` is a failure (kept as the last error); ``reason`` explains a result
    that is not one (a withdrawal)."""
    ctx.remove_download(job)
    ctx.state.history = [
        *ctx.state.history[-9:],
        {"model": job.model, "version": job.version, "result": result,
         "error": error or reason, "time": time.time(),
         **{k: v for k, v in (("probation", job.probation), ("shadow", job.shadow),
                              ("download", job.download), ("probe", job.probe)) if v}},
    ]  # fmt: skip
    ctx.state.job, ctx.state.last_error, ctx.state.progress = None, error, {}
    ctx.state.phase = "idle"
    ctx.save()
    ctx.report(result)


def commit_step(ctx: Context, job: Job) -> str:
    if not job.committed:
        if job.version not in ctx.api.ready_versions(job.model):
            log.warning("ota: %s version %d is not being served at commit (the server "
                        "restarted?): loading it again", job.model, job.version)  # fmt: skip
            return "load"
        ms = ctx.state.model(job.model)
        kept = [v for v in [job.previous, *ms.previous] if v and v != job.version]
        ms.current, ms.previous = job.version, kept[: ctx.cfg.keep_versions - 1]
        job.committed = True
        ctx.save()  # the commit point
        faults.point("commit:decided")
    finish_commit(ctx, job)
    return "idle"


def finish_commit(ctx: Context, job: Job) -> None:
    """Make disk and server agree with a committed job, then close it (idempotent)."""
    repo = ctx.cfg.model_repository
    ms = ctx.state.model(job.model)
    candidate = ctx.candidate_path(job)
    if candidate.exists():  # removed only after the config on disk was written
        config = ctx.candidate_config(job)
        install.write_config(repo, job.model, install.with_versions(config, [job.version]))
    faults.point("commit:config")
    serve(ctx, job.model, job.version)
    for v in install.disk_versions(repo, job.model):
        if v != job.version and v not in ms.previous:
            install.remove_version(repo, job.model, v)
    faults.point("commit:cleaned")
    candidate.unlink(missing_ok=True)
    keep_vectors(ctx, job)
    log.info("ota: %s version %d committed", job.model, job.version)
    finish(ctx, job, "updated")


def keep_vectors(ctx: Context, job: Job) -> None:
    """The committed version's self-test vectors, kept past its bundle: a software
    update runs them against the new server (idempotent, like the rest of the commit)."""
    try:
        vectors = bundle.first_manifest(ctx.bundle_path(job)).self_test
        selftest.keep(ctx.cfg.state_dir, job.model, job.version, vectors)
    except (OSError, OtaError) as exc:
        log.warning("ota: %s version %d: its self-test vectors were not kept (a software "
                    "update will probe it from its config instead): %s",
                    job.model, job.version, exc)  # fmt: skip


def rollback_step(ctx: Context, job: Job) -> str:
    repo = ctx.cfg.model_repository
    try:
        if job.previous:
            ctx.api.load_from_disk(job.model)  # the committed config: old version
        else:
            ctx.api.unload(job.model)
    except OtaError as exc:  # a server that is down loads the committed config itself
        log.warning("ota: rollback of %s: %s", job.model, exc)
    if job.previous:
        install.remove_version(repo, job.model, job.version)
    else:
        install.remove_model(repo, job.model)
    shutil.rmtree(install.staging_dir(repo, job.model, job.version), ignore_errors=True)
    ctx.candidate_path(job).unlink(missing_ok=True)
    ms = ctx.state.model(job.model)
    if job.bad and job.version not in ms.bad:
        ms.bad.append(job.version)
    reason = job.reason or "rolled back"
    result = job.result or "rolled_back"
    if result == "withdrawn":  # said once, as a warning, when it was withdrawn
        log.info("ota: %s version %d undone", job.model, job.version)
    else:
        log.error("ota: %s version %d %s: %s", job.model, job.version,
                  result.replace("_", " "), reason)  # fmt: skip
    if job.bad:
        finish(ctx, job, result, reason)
    else:
        finish(ctx, job, result, reason=reason)
    return "idle"


def serve(ctx: Context, model: str, version: int) -> None:
    """Make the server serve exactly ``version`` of ``model`` (reloaded from the config
    on disk when it serves anything else). Left alone while the server is down or the
    model is being loaded."""
    try:
        states = ctx.api.version_states(model)
        ready = sorted(v for v, s in states.items() if s == "READY")
        if ready == [version] or "LOADING" in states.values():
            return
        log.warning("ota: %s: the server serves %s, the committed version is %d: "
                    "loading the committed config", model, ready or "nothing", version)  # fmt: skip
        ctx.api.load_from_disk(model)
    except ServerGone:
        return  # it loads the config on disk when it starts
    except OtaError as exc:
        log.error("ota: %s: cannot make the server serve version %d: %s", model, version, exc)


def _pin(ctx: Context, model: str, version: int) -> None:
    repo = ctx.cfg.model_repository
    try:
        if install.pinned(repo, model) == (version,):
            return
        config = install.on_disk(repo, model)
        if config is None or version not in install.disk_versions(repo, model):
            log.error("ota: %s: the committed version %d is missing from %s", model, version, repo)
            return
        log.warning("ota: %s: the config on disk did not name the committed version %d: "
                    "pinned it", model, version)  # fmt: skip
        install.write_config(repo, model, install.with_versions(config, [version]))
    except OtaError as exc:
        log.error("ota: %s: cannot pin the committed version %d: %s", model, version, exc)


def converge(ctx: Context) -> None:
    """Repair disk and server toward the state's committed versions (see above)."""
    job = ctx.state.job
    if job is not None and job.committed:
        finish_commit(ctx, job)
    job = ctx.state.job
    for model, ms in list(ctx.state.models.items()):
        if not ms.current:
            continue
        if job is not None and job.model == model and ctx.state.phase in TOUCHING:
            continue
        _pin(ctx, model, ms.current)
        serve(ctx, model, ms.current)


def rebuild(cfg: OtaConfig) -> AgentState:
    """A state read back from the model repository: each model whose config on disk
    names exactly one version present on disk is committed at that version; the
    other, older version folders are the ones kept for rollback. Bad-version lists
    and the history are lost."""
    state = AgentState()
    repo = cfg.model_repository
    for folder in sorted(repo.iterdir()) if repo.is_dir() else []:
        if not folder.is_dir() or folder.name.startswith("."):
            continue
        try:
            pinned = install.pinned(repo, folder.name)
        except OtaError:
            continue
        versions = install.disk_versions(repo, folder.name)
        if pinned is None or len(pinned) != 1 or pinned[0] not in versions:
            continue
        current = pinned[0]
        older = sorted((v for v in versions if v < current), reverse=True)
        state.models[folder.name] = ModelState(current, older[: cfg.keep_versions - 1])
    return state
