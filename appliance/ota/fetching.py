"""Getting a bundle onto the device: the download, verify, waiting and stage steps.

- download: resumable and verified against the signed target (:mod:`appliance.ota.download`),
  after the disk-space rule (:mod:`appliance.ota.space`) said the bundle and its unpacked
  files fit; a job past ``job_deadline_s`` is dropped. When the fleet published a
  delta from the version this device serves, the delta (a signed target of its
  own) is downloaded instead and the full bundle rebuilt from it and the installed
  files (:mod:`appliance.ota.delta`, checked against the full target's signed content
  hashes); any failure there falls back to the full bundle.
- verify: the manifest and every member (:mod:`appliance.ota.bundle`), name and version equal
  to the signed target's, and the release rules of :mod:`appliance.ota.release` (the config
  as the server reads it, the backend the manifest, the config and the signed
  target claim, and the backend of what is installed).
- waiting: a verified bundle waits for a maintenance window (:mod:`appliance.ota.window`);
  each cycle re-checks that the fleet still wants it and reports that it waits.
- stage: the config on disk pinned to the committed version, then the version
  folder extracted to a hidden staging folder and renamed into place.

Each returns the next phase; refusals are OtaErrors (see :mod:`appliance.ota.agent`).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from tuf.api.metadata import TargetFile

from appliance.ota import OtaError, Transient, bundle, delta, download, install, release, space
from appliance.ota.context import Context, log
from appliance.ota.download import Limits
from appliance.ota.manifest import Manifest
from appliance.ota.state import Job

DELTA_TRIES = 3  # broken-off attempts at the delta before the full bundle is fetched


def _fetch(ctx: Context, job: Job, path: str, length: int, sha256: str) -> Path:
    """Download the signed target ``path`` into the downloads folder."""
    cfg = ctx.cfg
    folder, _, name = path.rpartition("/")
    limits = Limits(
        max_bandwidth=cfg.max_bandwidth,
        min_rate=cfg.min_download_rate,
        window_s=cfg.download_rate_window_s,
        deadline=job.started + cfg.job_deadline_s,
    )
    target = TargetFile(length, {"sha256": sha256}, path)
    url = f"{cfg.source}targets/{folder}/{sha256}.{name}"
    return download.fetch(ctx.http, url, target, ctx.downloads, limits, ctx.progress)


def _from_delta(ctx: Context, job: Job) -> None:
    """Rebuild the job's bundle from its delta. When that cannot be done (the base is
    not what the delta is from, a damaged or mismatched delta), the delta is
    forgotten and the full bundle is downloaded instead; Transient (the partial
    delta kept) when its download broke off, the first ``DELTA_TRIES - 1`` times (a
    mirror that lacks the delta answers 404 every time)."""
    d = job.delta
    try:
        base_version, length, sha256 = int(d["base"]), int(d["length"]), str(d["sha256"])
        path = str(d["target"])
        expected = {k: str(d[k]) for k in ("manifest_sha256", "config_sha256")}
        base = ctx.cfg.model_repository / job.model / str(base_version)
        if base_version != job.previous or not base.is_dir():
            raise OtaError(f"version {base_version}, which the delta is from, is not installed")
        delta_file = _fetch(ctx, job, path, length, sha256)
        try:
            delta.apply(delta_file, base, ctx.bundle_path(job), expected, ctx.cfg.max_bundle_bytes)
        finally:
            ctx.remove_files(sha256)  # used once, whatever came of it
    except download.Mismatch as exc:  # other bytes than were signed, even from byte 0
        _without_delta(ctx, job, str(exc))
    except Transient as exc:  # the partial delta is kept for the next attempt...
        tries = int(job.download.get("delta_tries", 0)) + 1
        job.download["delta_tries"] = tries
        if tries < DELTA_TRIES:
            raise
        _without_delta(ctx, job, f"{exc} ({tries} attempts)")  # ... a few times (a 404?)
    except (OtaError, KeyError, TypeError, ValueError) as exc:
        _without_delta(ctx, job, str(exc))
    else:
        job.download = {"how": "delta", "bytes": length, "saved": job.length - length}
        log.info("ota: %s version %d rebuilt from a %d-byte delta (%d bytes not downloaded)",
                 job.model, job.version, length, job.length - length)  # fmt: skip


def _without_delta(ctx: Context, job: Job, reason: str) -> None:
    log.warning("ota: %s version %d: the delta cannot be used, downloading the full "
                "bundle: %s", job.model, job.version, reason)  # fmt: skip
    ctx.remove_download(job)  # the delta's partial file too
    job.delta, job.download = {}, {"how": "full", "delta_failed": reason}
    ctx.save()


def download_step(ctx: Context, job: Job) -> str:
    cfg = ctx.cfg
    if not ctx.bundle_path(job).exists():
        part = ctx.downloads / f"{job.sha256}.part"
        have = part.stat().st_size if part.exists() else 0
        space.require(
            {
                ctx.downloads: job.length - have + int(job.delta.get("length", 0)),
                cfg.model_repository: job.unpacked,
            },
            cfg.reserve_disk,
            f"{job.model} version {job.version}",
        )
        if job.delta:
            _from_delta(ctx, job)
    _fetch(ctx, job, job.target, job.length, job.sha256)  # done already after a delta
    if job.download.get("how") != "delta":
        job.download["how"], job.download["bytes"] = "full", job.length
    return "verify"


def manifest_of(ctx: Context, job: Job) -> tuple[Manifest, bytes]:
    """The downloaded bundle's manifest and config, after checking every member."""
    manifest, config = bundle.read(ctx.bundle_path(job), ctx.cfg.max_bundle_bytes)
    if (manifest.name, manifest.version) != (job.model, job.version):
        raise OtaError(
            f"the bundle holds {manifest.name} version {manifest.version}, but the signed "
            f"target says {job.model} version {job.version}"
        )
    if bundle.machine() not in manifest.platforms:
        raise OtaError(f"the bundle is for {manifest.platforms}, not {bundle.machine()}")
    return manifest, config


def installed_backend(repository: Path, model: str, version: int) -> str:
    """The backend of the committed version on disk ("" for a fresh install)."""
    config = install.read_disk_config(repository, model) if version else None
    if config is None:
        return ""
    return release.backend_of(config, install.version_files(repository, model, version))


def verify_step(ctx: Context, job: Job) -> str:
    try:
        manifest, data = manifest_of(ctx, job)
        release.check_bundle(manifest, data, job.backend)
        old = installed_backend(ctx.cfg.model_repository, job.model, job.previous)
        release.check_backend(job.model, manifest.backend, old, "is installed")
    except OtaError:
        ctx.remove_download(job)
        raise
    return "waiting"


def waiting_step(ctx: Context, job: Job) -> str:
    """On to stage while a maintenance window is open; else the job waits (reported,
    so the fleet sees a device waiting, not a silent one)."""
    now = time.time()
    windows = ctx.cfg.windows()
    if windows.is_open(now):
        job.window_opens = 0.0
        return "stage"
    job.window_opens = windows.next_open(now)
    ctx.state.last_error = ""  # waiting is no failure
    ctx.save()
    ctx.report()
    log.info("ota: %s version %d is ready; it is applied once a maintenance window opens "
             "(in %.0f s)", job.model, job.version, job.window_opens - now)  # fmt: skip
    return "idle"


def stage_step(ctx: Context, job: Job) -> str:
    repo = ctx.cfg.model_repository
    manifest = bundle.first_manifest(ctx.bundle_path(job))  # the bundle is verified
    space.require(
        {repo: manifest.payload_bytes()}, ctx.cfg.reserve_disk, f"{job.model} version {job.version}"
    )
    if job.previous:  # pin the committed version on disk before the candidate lands
        current = install.on_disk(repo, job.model)
        if current is not None:
            install.write_config(repo, job.model, install.with_versions(current, [job.previous]))
    staging = install.staging_dir(repo, job.model, job.version)
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    manifest, data = bundle.extract(ctx.bundle_path(job), staging, ctx.cfg.max_bundle_bytes)
    config = release.check_bundle(manifest, data, job.backend)
    ctx.save_candidate_config(job, config)
    if not job.previous:  # fresh install: the model's config is the bundle's
        install.write_config(repo, job.model, install.with_versions(config, [job.version]))
    install.place(staging, repo, job.model, job.version)
    return "load"
