"""Getting a bundle onto the device: the download, verify and stage steps.

- download: resumable and verified against the signed target (:mod:`ota.download`),
  after the disk-space rule (:mod:`ota.space`) said the bundle and its unpacked
  files fit; a job past ``job_deadline_s`` is dropped.
- verify: the manifest and every member (:mod:`ota.bundle`), name and version equal
  to the signed target's, and the release rules of :mod:`ota.release` (the config
  as the server reads it, the backend the manifest, the config and the signed
  target claim, and the backend of what is installed).
- stage: the config on disk pinned to the committed version, then the version
  folder extracted to a hidden staging folder and renamed into place.

Each returns the next phase; refusals are OtaErrors (see :mod:`ota.agent`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tuf.api.metadata import TargetFile

from ota import OtaError, bundle, download, install, release, space
from ota.context import Context
from ota.download import Limits
from ota.manifest import Manifest
from ota.state import Job


def download_step(ctx: Context, job: Job) -> str:
    cfg = ctx.cfg
    target = TargetFile(job.length, {"sha256": job.sha256}, job.target)
    if not ctx.bundle_path(job).exists():
        part = ctx.downloads / f"{job.sha256}.part"
        have = part.stat().st_size if part.exists() else 0
        space.require(
            {ctx.downloads: job.length - have, cfg.model_repository: job.unpacked},
            cfg.reserve_disk,
            f"{job.model} version {job.version}",
        )
    folder, _, name = job.target.rpartition("/")
    url = f"{cfg.source}targets/{folder}/{job.sha256}.{name}"
    limits = Limits(
        max_bandwidth=cfg.max_bandwidth,
        min_rate=cfg.min_download_rate,
        window_s=cfg.download_rate_window_s,
        deadline=job.started + cfg.job_deadline_s,
    )
    download.fetch(ctx.http, url, target, ctx.downloads, limits, ctx.progress)
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
    return "stage"


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
