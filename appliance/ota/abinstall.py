"""A/B install of a software bundle: a venv per version, one ``current`` link.

Layout under ``<state_dir>/software/``: ``envs/<version>/`` (a venv, complete once
its ``.installed`` marker exists), ``current`` (a relative symlink to one env; the
systemd units run ``current/bin/python -m appliance ...``) and ``state.json``.

Steps of a software job (each saved before it acts):

- install: the verified bundle's wheels extracted, a new venv made beside the
  running one, the appliance installed into it offline (``--no-index`` from the
  bundle's wheels, under its constraints), then the marker written;
- flip: ``current`` replaced atomically (a temporary link renamed over it);
- restart: the configured command (``systemctl restart appliance`` by default);
- watch: the server must answer as the new version, READY, with every model that
  was READY before the flip READY again, and each that passed its self-test before
  the flip passing it again (the vectors of the bundle its version came in, kept at
  its commit; else a probe generated from its config, :mod:`appliance.ota.probes`),
  within ``software_ready_timeout_s``; then probation: for ``software_probation_s``
  it must keep answering so (a crash the service manager restarts is caught), and
  pass the self-tests again at its end;
- commit: one atomic state write (``committed`` = the new version, the job gone);
  envs beyond ``keep_versions`` removed, never the committed one nor the one before;
- rollback: ``current`` flipped back to the committed version, the restart command
  run again, the version marked bad.

The crash-consistency rule: ``committed`` in ``state.json`` is the one truth. At
every start (:func:`converge`) an env without its marker is removed; with no job,
``current`` is made to point at the committed env (and the server restarted when it
did not); a job that was flipped but not committed is watched again from the flip
(flip and restart are idempotent), and given up (rolled back) after
:data:`MAX_TRIES` starts; a rollback under way is finished.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import urllib3

from appliance.ota import OtaError, faults, install, probes, selftest, software
from appliance.ota.config import OtaConfig
from appliance.ota.server_api import ServerApi
from appliance.ota.state import fsync_dir

log = logging.getLogger("appliance.ota.software")
MAX_TRIES = 3  # starts of the watch before the version is given up
MARKER = ".installed"


class Layout:
    def __init__(self, cfg: OtaConfig) -> None:
        self.cfg = cfg
        self.root = cfg.state_dir / "software"
        self.envs = self.root / "envs"
        self.current = self.root / "current"
        self.state_file = self.root / "state.json"
        # the agent reports each step (and tells its hook the step, as for models)
        self.on_save: Callable[[dict[str, Any]], None] | None = None

    def load(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.state_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            doc = {}
        except (OSError, ValueError):
            doc = {}  # rebuilt from the link below
        if not isinstance(doc, dict):
            doc = {}
        doc.setdefault("committed", self.linked() or "")
        doc.setdefault("job", None)
        doc.setdefault("bad", [])
        return doc

    def save(self, doc: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        install.write_json(self.state_file, doc)
        if self.on_save is not None:
            self.on_save(doc)

    def linked(self) -> str:
        """The version ``current`` points at ("" without a link)."""
        try:
            return os.readlink(self.current).rpartition("/")[2]
        except OSError:
            return ""

    def flip(self, version: str) -> None:
        """Point ``current`` at ``version``'s env in one rename."""
        if self.linked() == version:
            return
        tmp = self.root / ".current.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(f"envs/{version}", tmp)
        os.replace(tmp, self.current)
        fsync_dir(self.root)

    def installed(self, version: str) -> bool:
        return (self.envs / version / MARKER).exists()


def install_env(lay: Layout, bundle_file: Path, manifest: software.SoftwareManifest) -> None:
    """Make ``envs/<version>`` from the verified bundle (idempotent)."""
    v = manifest.version
    env, incoming = lay.envs / v, lay.root / "incoming" / v
    if lay.installed(v):
        return
    shutil.rmtree(env, ignore_errors=True)
    shutil.rmtree(incoming, ignore_errors=True)
    incoming.mkdir(parents=True)
    try:
        software.read(bundle_file, lay.cfg.max_bundle_bytes, incoming)
        venv = [lay.cfg.software_python, "-m", "venv", str(env)]
        if lay.cfg.system_site_packages:
            venv.insert(3, "--system-site-packages")
        _run(venv, "making the venv")
        spec = f"{software.NAME}[{','.join(manifest.extras)}]" if manifest.extras else software.NAME
        _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index",
              "--disable-pip-version-check", "--find-links", str(incoming / "wheels"),
              "-c", str(incoming / "constraints.txt"), f"{spec}=={v}"],
             f"installing {software.NAME} {v}")  # fmt: skip
        shutil.copyfile(incoming / software.SBOM, env / software.SBOM)
        with open(env / MARKER, "w") as f:
            json.dump(manifest.to_json(), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(env)
    except BaseException:
        shutil.rmtree(env, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(incoming, ignore_errors=True)


def _run(cmd: list[str], what: str, timeout_s: float = 900) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.CalledProcessError as exc:
        raise OtaError(f"{what} failed: {(exc.stderr or exc.stdout).strip()[-600:]}") from None
    except (subprocess.TimeoutExpired, OSError) as exc:
        raise OtaError(f"{what} failed: {exc}") from None


def restart(cfg: OtaConfig) -> None:
    """The restart command; OtaError when it fails (``systemctl restart`` of a
    ``Type=notify`` unit waits for READY=1, so a server that cannot start fails here)."""
    _run(list(cfg.restart_command), "the restart command",
         timeout_s=max(120.0, cfg.software_ready_timeout_s))  # fmt: skip


def _get(http: urllib3.PoolManager, url: str) -> Any:
    r = http.request("GET", url, timeout=2.0, retries=False)
    return json.loads(r.data) if r.status == 200 and r.data.strip() else None


def ready_models(cfg: OtaConfig, http: urllib3.PoolManager) -> list[str]:
    """The models the server has READY now (empty when it does not answer)."""
    try:
        r = http.request("POST", cfg.server + "/v2/repository/index", json={}, timeout=5.0,
                         retries=False, headers=_auth(cfg))  # fmt: skip
        rows = json.loads(r.data) if r.status == 200 else []
    except (urllib3.exceptions.HTTPError, ValueError):
        return []
    ready = {str(x["name"]) for x in rows if isinstance(x, dict) and x.get("state") == "READY"}
    return sorted(ready)


def _auth(cfg: OtaConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.admin_token}"} if cfg.admin_token else {}


def watch(cfg: OtaConfig, version: str, models: list[str],
          probed: list[str] | None = None) -> str:  # fmt: skip
    """Why the server does not come up as ``version`` with ``models`` READY and those
    of ``probed`` (default: all of them) answering a generated probe within the
    timeout, or ""."""
    http = urllib3.PoolManager(maxsize=1)
    deadline = time.monotonic() + cfg.software_ready_timeout_s
    why = f"the server did not answer as version {version}"
    while time.monotonic() < deadline:
        try:
            meta = _get(http, cfg.server + "/v2")
        except (urllib3.exceptions.HTTPError, ValueError):
            meta = None
        if isinstance(meta, dict) and meta.get("version") == version:
            have = set(ready_models(cfg, http))
            missing = [m for m in models if m not in have]
            why = f"version {version} runs, but not READY with {missing or 'its models'}"
            if not missing:
                failed = _probe_all(cfg, models if probed is None else probed)
                if not failed:
                    return probation(cfg, version, models, probed, http)
                why = failed
        time.sleep(0.2)
    return f"{why} within {cfg.software_ready_timeout_s:g} s"


# a server that does not answer as its version, with its models READY, at this many
# polls in a row (0.25 s apart) during probation has stopped (a crash and a restart by
# the service manager take longer than that)
PROBATION_MISSES = 2


def probation(cfg: OtaConfig, version: str, models: list[str], probed: list[str] | None,
              http: urllib3.PoolManager) -> str:  # fmt: skip
    """Why the new server, READY and self-tested, did not stay so for
    ``software_probation_s`` (""): polled every 0.25 s, it must keep answering as
    ``version`` with ``models`` READY, and pass the self-tests again at the end."""
    deadline = time.monotonic() + cfg.software_probation_s
    misses = 0
    while time.monotonic() < deadline:
        time.sleep(0.25)
        try:
            meta = _get(http, cfg.server + "/v2")
        except (urllib3.exceptions.HTTPError, ValueError):
            meta = None
        up = isinstance(meta, dict) and meta.get("version") == version
        missing = [m for m in models if m not in set(ready_models(cfg, http))] if up else models
        misses = 0 if up and not missing else misses + 1
        if misses >= PROBATION_MISSES:
            what = f"lost {missing}" if up else "stopped answering"
            return f"version {version} {what} during its probation"
    if cfg.software_probation_s <= 0:
        return ""
    failed = _probe_all(cfg, models if probed is None else probed)
    return f"{failed} (at the end of its probation)" if failed else ""


def _probe_all(cfg: OtaConfig, models: list[str]) -> str:
    """Why a model that answered a generated probe before the flip does not answer
    one now ("")."""
    for m in models:
        why = _probe(cfg, m)
        if why:
            return f"model {m} does not answer on the new version: {why}"
    return ""


def _probe(cfg: OtaConfig, model: str) -> str:
    """Why ``model`` does not pass its self-test: the vectors of the bundle its served
    version came in (kept at its commit, :func:`selftest.keep`), else a probe generated
    from its config ("", also for a model the agent cannot probe: READY is what it
    has)."""
    api = ServerApi(cfg.server, cfg.admin_token, cfg.request_timeout_s)
    try:
        version = api.ready_versions(model)[-1]
        vectors = selftest.kept(cfg.state_dir, model, version)
        if vectors:
            selftest.run(api, model, version, vectors)
            return ""
        config = install.on_disk(cfg.model_repository, model)
        if config is None or probes.inputs_of(config)[1]:
            return ""
        probes.check(api, model, version, config, 0, cfg.probe_timeout_s)
    except (OtaError, IndexError) as exc:
        return str(exc)
    return ""


def answering(cfg: OtaConfig, models: list[str]) -> list[str]:
    """The models that pass their self-test (kept vectors, else a generated probe) on
    the running version, before the flip: only those must pass it after. A generated
    probe is zeros of each input's declared type and shape, which some models refuse
    on any version (an image decoder's BYTES input gets empty bytes: the demo
    ``image_classifier``); such a model must come back READY, as one the agent cannot
    probe."""
    return [m for m in models if not _probe(cfg, m)]


def run_job(cfg: OtaConfig, lay: Layout, doc: dict[str, Any]) -> str:
    """Drive the saved job to its end; the result (``updated`` or ``rolled_back``)."""
    job = doc["job"]
    v, old = str(job["version"]), str(doc["committed"])
    if job["phase"] == "rollback":
        return _rollback(cfg, lay, doc, job.get("reason", "rolled back"))
    job["tries"] = int(job.get("tries", 0)) + 1
    job["phase"] = "flip"
    lay.save(doc)
    if job["tries"] > MAX_TRIES:
        return _rollback(cfg, lay, doc, f"the agent was interrupted {MAX_TRIES} times")
    faults.point("software:flip")
    lay.flip(v)
    job["phase"] = "restart"
    lay.save(doc)
    faults.point("software:restart")
    try:
        restart(cfg)
    except OtaError as exc:
        return _rollback(cfg, lay, doc, str(exc))
    job["phase"] = "watch"
    lay.save(doc)
    faults.point("software:watch")
    probed = job.get("probed")  # (a job saved before the agent recorded them: all)
    why = watch(cfg, v, list(job.get("models", [])), None if probed is None else list(probed))
    if why:
        return _rollback(cfg, lay, doc, why)
    doc["committed"], doc["previous"], doc["job"] = v, old, None  # the commit point
    doc["last"] = {"version": v, "result": "updated", "time": time.time()}
    lay.save(doc)
    faults.point("software:committed")
    prune(lay, doc)
    log.info("ota: software %s committed (was %s)", v, old)
    return "updated"


def _rollback(cfg: OtaConfig, lay: Layout, doc: dict[str, Any], reason: str) -> str:
    job = doc["job"]
    job["phase"], job["reason"] = "rollback", reason
    lay.save(doc)
    log.error("ota: software %s rolled back: %s", job["version"], reason)
    faults.point("software:rollback")
    old = str(doc["committed"])
    if old and lay.installed(old):
        lay.flip(old)
        try:
            restart(cfg)
        except OtaError as exc:
            log.error("ota: restarting software %s: %s", old, exc)
    if job["version"] not in doc["bad"]:
        doc["bad"].append(job["version"])
    doc["job"] = None
    doc["last"] = {"version": job["version"], "result": "rolled_back", "error": reason,
                   "time": time.time()}  # fmt: skip
    lay.save(doc)
    shutil.rmtree(lay.envs / str(job["version"]), ignore_errors=True)
    return "rolled_back"


def prune(lay: Layout, doc: dict[str, Any]) -> None:
    """Envs beyond ``keep_versions`` (newest kept), never the committed one or the
    one to roll back to; half-made ones always."""
    keep = {str(doc.get("committed", "")), str(doc.get("previous", ""))}
    if doc.get("job"):
        keep.add(str(doc["job"]["version"]))
    envs = [p for p in lay.envs.iterdir() if p.is_dir()] if lay.envs.is_dir() else []
    complete = sorted((p for p in envs if (p / MARKER).exists()),
                      key=lambda p: software.version_key(p.name), reverse=True)  # fmt: skip
    for p in envs:
        if p.name in keep:
            continue
        if not (p / MARKER).exists() or complete.index(p) >= lay.cfg.keep_versions:
            shutil.rmtree(p, ignore_errors=True)


def converge(cfg: OtaConfig) -> str:
    """Make the link and what runs agree with the state after a crash; finish a job
    under way. The result of a finished job, or ""."""
    lay = Layout(cfg)
    if not lay.root.exists():
        return ""
    doc = lay.load()
    if doc["job"] is not None:
        if doc["job"].get("phase") == "install":
            doc["job"] = None  # nothing was flipped: the next check takes it again
            lay.save(doc)
        else:
            return run_job(cfg, lay, doc)
    shutil.rmtree(lay.root / "incoming", ignore_errors=True)
    prune(lay, doc)
    committed = str(doc["committed"])
    if committed and lay.installed(committed) and lay.linked() != committed:
        log.warning("ota: current pointed at %s, the committed software is %s: flipping back",
                    lay.linked(), committed)  # fmt: skip
        lay.flip(committed)
        restart(cfg)
    return ""


def rescue(cfg: OtaConfig) -> tuple[bool, str]:
    """The unit-level rule's action (``appliance ota rescue``, run by
    ``OnFailure=`` when the agent of the committed version cannot start): flip back
    to the version it replaced, mark it bad, restart the server. (Whether it rolled
    back, what it did): with nothing to roll back to, the command fails, so the rescue
    unit does not start the agent again (it would fail again, and the rule would run
    the rescue again, in a loop)."""
    lay = Layout(cfg)
    doc = lay.load()
    job = doc.get("job")
    failing = str(job["version"]) if job else str(doc["committed"])
    back = str(doc["committed"]) if job else str(doc.get("previous", ""))
    if not back or back == failing or not lay.installed(back):
        return False, f"nothing to roll back to from software {failing or 'none'}"
    if failing not in doc["bad"]:
        doc["bad"].append(failing)
    doc["committed"], doc["job"] = back, None
    why = "its update agent could not start (rescued by the unit rule)"
    doc["last"] = {"version": failing, "result": "rolled_back", "time": time.time(), "error": why}
    lay.save(doc)
    lay.flip(back)
    restart(cfg)
    return True, f"software {failing} rolled back to {back}"
