"""Handlers of the OTA commands registered by :mod:`appliance.ota.cli`."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError
from appliance.ota import (
    OtaError,
    abinstall,
    bundle,
    controls,
    devicekey,
    keys,
    offline,
    repo,
    report,
    sealing,
    software,
    watch,
)
from appliance.ota import config as ota_config
from appliance.ota.agent import Agent
from appliance.ota.rollout import Rollout
from appliance.ota.state import StateFile
from appliance.sdnotify import Notifier

SOFTWARE_UPDATED = 3  # the agent exits so its unit starts the new one from ``current``


def run(args: argparse.Namespace) -> int:
    """Run the command ``args`` names; the exit status."""
    try:
        if args.command == "fleet":
            return _fleet(args)
        if args.command == "bundle":
            return _bundle(args)
        return _ota(args)
    except (OtaError, ApplianceError) as exc:
        print(f"appliance: error: {exc}", file=sys.stderr)
        return 2


def _fleet(args: argparse.Namespace) -> int:
    cmd = args.fleet_command
    if cmd == "keys":
        keys.generate(args.dir)
        print(f"keys written to {args.dir}; keep root.pem offline")
    elif cmd == "init":
        root = repo.init(args.repo, args.keys)
        print(f"repository in {args.repo}; devices pin {root}")
    elif cmd == "publish":
        phases = tuple(args.phases)
        percent = phases[0] if phases else args.percent
        rollout = Rollout(args.channel, percent, tuple(args.group), phases=phases)
        target = repo.publish(
            args.repo, args.keys, args.file, rollout, delta_from=tuple(args.delta_from)
        )
        print(
            f"published {target.path} ({target.length} bytes) to "
            f"{json.dumps(rollout.to_json(), sort_keys=True)}"
        )
        for base, info in sorted(repo.deltas_of(target).items()):
            print(f"  delta from version {base}: {info['length']} bytes ({info['path']})")
        is_software = software.first(args.file).get("kind") == software.KIND
        manifest = None if is_software else bundle.first_manifest(args.file)
        if manifest is not None and not manifest.self_test:
            print(
                f"appliance: warning: {manifest.name} version {manifest.version} has no "
                "self-test vectors: devices probe it with inputs generated from its config, "
                "which proves it answers, not that it answers right (bundle build --self-test)",
                file=sys.stderr,
            )
    elif cmd == "rollout":
        halted = True if args.halt else (False if args.resume else None)
        new = controls.set_rollout(
            args.repo, args.keys, args.model, args.version, args.percent, halted,
            retry_failed=args.retry_failed, approve=args.approve or "",
            pin=tuple(args.pin or ()), unpin=tuple(args.unpin or ()),
        )  # fmt: skip
        print(f"{args.model}: {json.dumps(new.to_json(), sort_keys=True)}")
    elif cmd == "refresh":
        ts = repo.refresh(args.repo, args.keys)
        print(f"timestamp version {ts.version} signed; it expires {ts.expires.isoformat()}")
    elif cmd == "remove":
        repo.remove(args.repo, args.keys, args.model, args.version)
        print(f"{args.model} version {args.version} removed from the signed targets")
    elif cmd == "export":
        paths = offline.export(args.repo, args.output, tuple(args.target))
        print(f"{args.output}: the metadata and {len(paths)} target(s): {', '.join(paths)}")
    elif cmd == "rotate":
        version = repo.rotate(args.repo, args.keys, args.role)
        print(f"{args.role} key rotated; root version {version}")
    else:
        return watch.main(args)
    return 0


def _bundle(args: argparse.Namespace) -> int:
    if args.bundle_command == "build-software":
        sw = software.build(
            args.output, args.constraints, wheel=args.wheel, source=args.source,
            deps=args.wheels, python=args.python, platform=args.platform,
            extras=tuple(e for e in args.extras.split(",") if e),
        )  # fmt: skip
        print(f"software {sw.version} for Python {sw.python} on {sw.platform}: "
              f"{len(sw.files)} files, SBOM sha256 {sw.sbom_sha256} -> {args.output}")  # fmt: skip
        return 0
    if args.bundle_command == "inspect":
        print(bundle.describe(bundle.inspect(args.file, args.max_size)))
        return 0
    bundle.version_folder(args.model_dir, args.version)  # named before the files beside it
    vectors = _json_file(args.self_test, list, "a JSON list of self-test vectors")
    policy = _json_file(args.shadow, dict, "a JSON object (a shadow probation policy)")
    manifest = bundle.build(
        args.model_dir,
        args.version,
        args.output,
        args.min_appliance_version,
        tuple(args.platform or ("x86_64", "aarch64")),
        tuple(args.device or ("cpu",)),
        args.memory_bytes,
        vectors,
        policy,
        tuple(args.seal_to),
    )
    print(f"{args.output}: {manifest.name} version {manifest.version}, "
          f"{len(manifest.files)} file(s), {manifest.payload_bytes()} bytes")  # fmt: skip
    return 0


def _json_file(path: Path | None, kind: type, what: str) -> Any:
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise OtaError(f"{path}: expected {what}: {exc}") from None
    if not isinstance(doc, kind):
        raise OtaError(f"{path}: expected {what}")
    return doc


def _ota(args: argparse.Namespace) -> int:
    if args.ota_command == "model-key":
        print(sealing.model_key(args.key_file))
        return 0
    cfg = ota_config.load(args.config)
    if args.ota_command == "status":
        store = StateFile(cfg.state_dir)
        state = store.load()
        doc: dict[str, Any] = state.to_json() if state is not None else {"phase": "unknown"}
        if state is not None:
            doc["next_check_in_s"] = round(max(0.0, state.next_check - time.time()), 1)
            if state.job is not None and state.phase == "waiting":  # for a maintenance window
                doc["window_opens_in_s"] = round(max(0.0, state.job.window_opens - time.time()))
        if store.note:  # a damaged state file: what the agent does about it
            doc["note"] = store.note
        key = devicekey.load(cfg.state_dir, create=False)  # registered with the fleet
        doc["report_key"] = devicekey.public_text(key) if key is not None else None
        doc["software"] = report.software_of(cfg.state_dir / "software")
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    if args.ota_command == "rescue":
        rolled_back, what = abinstall.rescue(cfg)
        print(what)
        return 0 if rolled_back else 1  # 1: its unit does not start the agent again
    if args.ota_command == "import":
        ok, done = offline.import_file(cfg, args.file)
        for entry in done:
            print(json.dumps(entry, sort_keys=True))
        if not done:
            print(f"nothing in {args.file} applies to this device (already installed, another "
                  "platform or Python, or outside its rollout)")  # fmt: skip
        return 0 if ok else 1
    agent = Agent(cfg)
    try:
        if args.once:
            return 0 if agent.run_once() else 1
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        notifier = Notifier()  # systemd's Type=notify; nothing outside systemd
        watchdog = _watchdog(notifier, agent, stop)
        notifier.notify("READY=1", f"STATUS=checking {cfg.source} every {cfg.check_interval_s:g}s")
        agent.run_forever(stop)
        notifier.notify("STOPPING=1")
        stop.set()
        if watchdog is not None:
            watchdog.join()
        return SOFTWARE_UPDATED if agent.software_updated else 0
    finally:
        agent.close()


def _watchdog(notifier: Notifier, agent: Agent, stop: threading.Event) -> threading.Thread | None:
    """WATCHDOG=1 at the interval systemd asks, while the agent shows it is alive (it
    saved its state or waited idle within the watchdog period): a hung agent stops the
    pings and systemd restarts it; it resumes from its state file."""
    interval = notifier.watchdog_s
    if interval is None:
        return None
    limit = 2 * interval  # WatchdogSec: systemd's own deadline

    def ping() -> None:
        while not stop.wait(interval):
            if time.monotonic() - agent.alive_at < limit:
                notifier.notify("WATCHDOG=1")

    thread = threading.Thread(target=ping, name="ota-watchdog", daemon=True)
    thread.start()
    return thread
