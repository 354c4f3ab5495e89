"""The OTA commands: ``appliance fleet ...``, ``appliance bundle ...``, ``appliance ota ...``.

:func:`register` adds them to the main parser; each handler returns the exit
status. Refusals and bad input print one line (``appliance: error: ...``) and exit
non-zero, never a traceback. The handlers (:mod:`appliance.ota.commands`) are imported only
when one of these commands runs, so ``appliance serve`` works without the ``ota``
extra installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from appliance.config.fields import ConfigError, parse_size

KEYS = "folder of the role keys (appliance fleet keys)"
HALT_AT = "halt a rollout once the share of its devices that failed exceeds this (default 0.2)"
REPORT_TIMEOUT = "seconds a device may stay silent mid-update before it counts as failed"
PLATFORM = "a CPU architecture the bundle serves on (repeatable; default: any)"
DEVICE = "a device kind the bundle serves on (repeatable; default: any)"
SEAL_TO = (
    "encrypt the model files to this public key line or file of lines (repeatable; "
    "appliance ota model-key prints a device's)"
)
DELTA_FROM = "an older bundle of the model: publish a delta from it too (repeatable)"
RETRY = "the devices that failed on this version take it again (after a fix)"
PIN = "this device takes this version and no other of the model (repeatable)"
PHASES = "percents the rollout widens through, each by fleet rollout --approve (1,10,100)"
TARGET = "a target path to include (repeatable; default: every current target)"
WHEELS = (
    "a folder of the dependency wheels for the target (default: pip download them for "
    "--platform and --python under --constraints)"
)
CONFIG = Path("/etc/appliance/appliance.yaml")


def register(sub: Any) -> None:
    fleet = sub.add_parser("fleet", help="fleet side: TUF keys, repository, rollouts")
    fs = fleet.add_subparsers(dest="fleet_command", required=True)
    p = fs.add_parser("keys", help="generate ed25519 keys for the four TUF roles")
    p.add_argument("dir", type=Path, help="folder for the key files (keep it offline)")
    p = fs.add_parser("init", help="create a signed TUF repository in a folder")
    p.add_argument("repo", type=Path, help="folder of the TUF repository")
    p.add_argument("--keys", type=Path, required=True, help=KEYS)
    p = fs.add_parser("publish", help="publish a bundle with its rollout settings")
    p.add_argument("repo", type=Path, help="folder of the TUF repository")
    p.add_argument("file", type=Path, help="the bundle (appliance bundle build)")
    p.add_argument("--keys", type=Path, required=True, help=KEYS)
    p.add_argument("--channel", choices=["stable", "beta"], default="stable", help="channel")
    p.add_argument("--percent", type=float, default=100.0, help="share of devices to offer it")
    p.add_argument("--group", action="append", default=[], help="device group (repeatable)")
    p.add_argument("--delta-from", action="append", type=Path, default=[], help=DELTA_FROM)
    p.add_argument("--phases", type=_phases, default=(), help=PHASES)
    p = fs.add_parser("rollout", help="widen, halt or resume a model's rollout")
    p.add_argument("repo", type=Path, help="folder of the TUF repository")
    p.add_argument("model", help="the model whose rollout changes")
    p.add_argument("--keys", type=Path, required=True, help=KEYS)
    p.add_argument("--version", default="", help="default: the newest published")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--percent", type=float, help="widen (or narrow) to this share of devices")
    g.add_argument("--halt", action="store_true", help="stop offering the version")
    g.add_argument("--resume", action="store_true", help="offer a halted version again")
    g.add_argument("--retry-failed", action="store_true", help=RETRY)
    g.add_argument("--approve", metavar="NAME", help="widen to the next phase, approved by NAME")
    g.add_argument("--pin", action="append", metavar="DEVICE", help=PIN)
    g.add_argument("--unpin", action="append", metavar="DEVICE", help="release a pinned device")
    p = fs.add_parser("remove", help="withdraw a published version from the signed targets")
    p.add_argument("repo", type=Path, help="folder of the TUF repository")
    p.add_argument("model", help="the model of the version to withdraw")
    p.add_argument("--version", type=int, required=True, help="the version to withdraw")
    p.add_argument("--keys", type=Path, required=True, help=KEYS)
    p = fs.add_parser("refresh", help="re-sign the timestamp (run it from a daily timer)")
    p.add_argument("repo", type=Path, help="folder of the TUF repository")
    p.add_argument("--keys", type=Path, required=True, help=KEYS)
    p = fs.add_parser("export", help="the metadata and bundles in one file, for offline sites")
    p.add_argument("repo", type=Path, help="folder of the TUF repository")
    p.add_argument("-o", "--output", type=Path, required=True, help="the file to write")
    p.add_argument("--target", action="append", default=[], help=TARGET)
    p = fs.add_parser("rotate", help="replace a role's key (new root signed by the old)")
    p.add_argument("repo", type=Path, help="folder of the TUF repository")
    p.add_argument("role", choices=["root", "targets", "snapshot", "timestamp"], help="role")
    p.add_argument("--keys", type=Path, required=True, help=KEYS)
    p = fs.add_parser("watch", help="follow device reports; halt a failing rollout")
    p.add_argument("--mqtt", required=True, metavar="HOST:PORT", help="the MQTT broker")
    p.add_argument("--prefix", default="appliance", help="the devices' MQTT topic prefix")
    p.add_argument("--halt-at-failure-rate", type=float, default=0.2, help=HALT_AT)
    p.add_argument(
        "--min-reports",
        type=int,
        default=5,
        help="devices that must have reported on a version before it is judged (default 5)",
    )
    p.add_argument("--report-timeout-s", type=float, default=3600.0, help=REPORT_TIMEOUT)
    p.add_argument(
        "--device-keys",
        type=Path,
        help="folder of <device_id>.pub report keys: count only reports they sign",
    )
    p.add_argument("--username", help="the watcher's broker user (see the broker ACL)")
    p.add_argument("--password", default=None, help="the watcher's broker password")
    p.add_argument("--repo", type=Path, help="TUF repository to halt rollouts in")
    p.add_argument("--keys", type=Path, help=KEYS)
    p.add_argument("--model", help="the model to watch (default: every model)")
    p.add_argument("--duration-s", type=float, default=0.0, help="stop after (0: never)")
    p.add_argument("--exit-on-halt", action="store_true", help="exit once it halted a rollout")
    p.add_argument(
        "--devices",
        action="store_true",
        help="also print each device: its software version and SBOM, its model versions",
    )

    b = sub.add_parser("bundle", help="build and inspect model bundles")
    bs = b.add_subparsers(dest="bundle_command", required=True)
    p = bs.add_parser("build", help="bundle <model dir>/<version> (reproducible)")
    p.add_argument("model_dir", type=Path, help="the model's folder in a repository")
    p.add_argument("--version", type=int, required=True, help="the version folder to bundle")
    p.add_argument("-o", "--output", type=Path, required=True, help="the bundle file to write")
    p.add_argument("--min-appliance-version", default="0.1.0", help="oldest server it needs")
    p.add_argument("--platform", action="append", choices=["x86_64", "aarch64"], help=PLATFORM)
    p.add_argument("--device", action="append", choices=["cpu", "gpu"], help=DEVICE)
    p.add_argument("--memory-bytes", type=int, default=0, help="default: the files' size")
    p.add_argument("--self-test", type=Path, help="JSON list of self-test vectors")
    p.add_argument("--shadow", type=Path, help="JSON shadow probation policy (docs/ota.md)")
    p.add_argument("--seal-to", action="append", default=[], metavar="KEY", help=SEAL_TO)
    p = bs.add_parser("build-software", help="bundle the appliance itself, its wheels and SBOM")
    p.add_argument("-o", "--output", type=Path, required=True, help="the bundle file to write")
    p.add_argument("--wheel", type=Path, help="the appliance wheel (else built)")
    p.add_argument("--source", type=Path, default=Path("."), help="the project to build it from")
    p.add_argument("--wheels", type=Path, help=WHEELS)
    p.add_argument("--constraints", type=Path, default=Path("constraints.txt"), help="the pins")
    p.add_argument("--python", default="", help="the target's Python, e.g. 3.11 (default: this)")
    p.add_argument("--platform", choices=["x86_64", "aarch64"], help="default: this machine's")
    p.add_argument("--extras", default="ota", help="extras to install (default: ota)")
    p = bs.add_parser("inspect", help="show a bundle's manifest after checking every member")
    p.add_argument("file", type=Path, help="the bundle file")
    p.add_argument(
        "--max-size",
        type=_size,
        default=4 << 30,
        help="read at most this much content (default 4GiB, the agent's max_bundle_size)",
    )

    o = sub.add_parser("ota", help="the device's update agent")
    os_ = o.add_subparsers(dest="ota_command", required=True)
    p = os_.add_parser("agent", help="run the update agent")
    p.add_argument("--config", type=Path, default=CONFIG, help="the server config (its ota:)")
    p.add_argument("--once", action="store_true", help="one cycle, then exit 0 / 1")
    p = os_.add_parser("status", help="the agent's state")
    p.add_argument("--config", type=Path, default=CONFIG, help="the server config (its ota:)")
    p = os_.add_parser("import", help="install from an export file (appliance fleet export)")
    p.add_argument("file", type=Path, help="the export file")
    p.add_argument("--config", type=Path, default=CONFIG, help="the server config (its ota:)")
    p = os_.add_parser("rescue", help="roll software back when its agent cannot start")
    p.add_argument("--config", type=Path, default=CONFIG, help="the server config (its ota:)")
    p = os_.add_parser("model-key", help="the key sealed models open with (made if missing)")
    p.add_argument("key_file", type=Path, help="the private key file (the server's model_key_file)")


def _phases(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected percents like 1,10,100, got {text!r}") from None


def _size(text: str) -> int:
    try:
        return parse_size(text, "--max-size", "")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Run the command ``args`` names; the exit status."""
    try:
        commands = importlib.import_module("appliance.ota.commands")
    except ImportError as exc:
        print(
            f"appliance: error: the OTA commands need the 'ota' extra ({exc.name} is "
            "missing): pip install 'appliance[ota]'",
            file=sys.stderr,
        )
        return 2
    status: int = commands.run(args)
    return status
