"""Software updates in the agent's cycle: the newest signed software release this
device should run, downloaded, verified and installed A/B (:mod:`appliance.ota.abinstall`).

A software release is a TUF target of its own kind (``custom.appliance.kind:
software``) with the same rollout settings as a model's (channel, percent, groups,
halted), so the same phases, reports and auto-halt apply; the rollout bucket is the
device's for the model name ``appliance``. The device takes the newest release that
includes it, is not marked bad, is for its platform and Python and is newer than the
committed one (:func:`appliance.ota.software.check_device`). The download is resumable and
verified against the signed target like a bundle's (:mod:`appliance.ota.download`).
"""

from __future__ import annotations

import shutil
import time
from functools import partial
from typing import Any

from tuf.api.metadata import Metadata, TargetFile, Targets

from appliance.ota import OtaError, Transient, abinstall, check, download, faults, software
from appliance.ota.context import Context, log
from appliance.ota.download import Limits
from appliance.ota.rollout import Rollout


def installed(ctx: Context) -> str:
    """The committed software version: the A/B state's, else the running agent's."""
    committed = str(abinstall.Layout(ctx.cfg).load()["committed"])
    if committed:
        return committed
    from appliance.version import __version__

    return __version__


def offer(ctx: Context, targets: Metadata[Targets]) -> tuple[TargetFile, dict[str, Any]] | None:
    """The newest software release for this device, or None (always None on a device
    the image did not lay out for A/B: no ``current`` link, nothing to flip back to)."""
    lay = abinstall.Layout(ctx.cfg)
    if not lay.linked():
        return None
    have, bad = installed(ctx), lay.load()["bad"]
    best: tuple[TargetFile, dict[str, Any]] | None = None
    for target in targets.signed.targets.values():
        custom = target.custom if isinstance(target.custom, dict) else {}
        info = custom.get("appliance")
        if not isinstance(info, dict) or info.get("kind") != software.KIND:
            continue
        try:
            rollout = Rollout.from_json(info.get("rollout", {}))
            version = str(info["version"])
            key = software.version_key(version)
        except (KeyError, TypeError, ValueError, OtaError):
            continue
        cfg = ctx.cfg
        if version in bad or not rollout.includes(software.NAME, cfg.device_id, cfg.channel,
                                                   cfg.groups):  # fmt: skip
            continue
        if software.check_device(info, have):
            continue
        if best is None or key > software.version_key(str(best[1]["version"])):
            best = (target, info)
    return best


def _saved(ctx: Context, doc: dict[str, Any]) -> None:
    ctx.report()
    job = doc.get("job")
    if ctx.hook is not None and isinstance(job, dict):
        ctx.hook(f"software:{job.get('phase')}")


def run(ctx: Context, fresh: check.Fresh) -> str:
    """Take and install the newest software release; its result, or "" for none.
    OtaError when the download or bundle is refused."""
    found = offer(ctx, fresh.targets)
    if found is None:
        return ""
    target, info = found
    version, cfg = str(info["version"]), ctx.cfg
    if not cfg.windows().is_open(time.time()):
        log.info("ota: software %s waits for a maintenance window", version)
        return ""
    lay = abinstall.Layout(cfg)
    lay.on_save = partial(_saved, ctx)  # each step reported, as a model job's
    digest = target.hashes.get("sha256", "")
    folder, _, name = target.path.rpartition("/")
    url = f"{cfg.source}targets/{folder}/{digest}.{name}"
    log.info("ota: software %s offered (installed: %s)", version, installed(ctx))
    limits = Limits(max_bandwidth=cfg.max_bandwidth, min_rate=cfg.min_download_rate,
                    window_s=cfg.download_rate_window_s)  # fmt: skip
    path = download.fetch(ctx.http, url, target, ctx.downloads, limits, ctx.progress)
    try:
        manifest = software.read(path, cfg.max_bundle_bytes)
        if manifest.version != version:
            raise OtaError(f"the bundle holds software {manifest.version}, signed as {version}")
        why = software.check_device(manifest.summary(), installed(ctx))
        if why:
            raise OtaError(why)
        doc = lay.load()
        ready = abinstall.ready_models(cfg, ctx.http)
        doc["job"] = {"version": version, "phase": "install", "models": ready,
                      "probed": abinstall.answering(cfg, ready)}  # fmt: skip
        lay.save(doc)
        faults.point("software:install")
        abinstall.install_env(lay, path, manifest)
        again = offer(ctx, check.refresh(cfg).targets)  # the fleet may have changed its mind
        if again is None or again[0].hashes != target.hashes:
            shutil.rmtree(lay.envs / version, ignore_errors=True)
            doc["job"] = None
            doc["last"] = {"version": version, "result": "withdrawn", "time": time.time()}
            lay.save(doc)
            log.warning("ota: software %s withdrawn by the fleet before the flip", version)
            return "withdrawn"
        return abinstall.run_job(cfg, lay, doc)
    except Transient:  # passing: the job is taken again at the next check
        doc = lay.load()
        doc["job"] = None
        lay.save(doc)
        raise
    except OtaError as exc:
        doc = lay.load()
        doc["job"] = None
        if version not in doc["bad"]:
            doc["bad"].append(version)
        doc["last"] = {"version": version, "result": "refused", "error": str(exc)}
        lay.save(doc)
        raise
    finally:
        ctx.remove_files(digest)
