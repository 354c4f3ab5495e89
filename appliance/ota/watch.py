"""``appliance fleet watch``: follow the devices' OTA reports, halt a failing rollout.

Subscribes to the retained ``<prefix>/+/ota`` reports and keeps each device's
latest one. A report is the device's state (:mod:`appliance.ota.report`), so a watcher that
starts late reads the retained reports into the same counts as one that ran all
along. Per model version it counts devices pending (an update under way),
updated, failed (refused or an error), rolled back and withdrawn (the fleet
halted or removed the version under way: shown, never counted as a failure), plus
devices silent for longer than the report timeout mid-update (counted as failed;
the report's own time says how long, not when the watcher happened to receive it). Once at least
``min_reports`` devices reported on a version and the failed share exceeds the
threshold, the rollout is halted by re-signing the targets with ``halted: true``
(as hawkBit and AWS IoT Jobs stop a rollout on an error threshold).

Reports are input from outside: one that is not a JSON object of the expected
shape is skipped and counted, never a crash. With ``--device-keys`` only reports
signed by the key registered for the device the topic names count
(:mod:`appliance.ota.devicekey`); others are counted as unauthenticated.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import queue
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import paho.mqtt.client as mqtt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from paho.mqtt.enums import CallbackAPIVersion

from appliance.ota import OtaError, controls, devicekey, software
from appliance.ota.rollout import check_name

FAILED = {"rolled_back", "refused", "error"}
UNDER_WAY = ("check", "download", "verify", "waiting", "stage", "load", "self_test", "shadow",
             "switch", "probation", "commit", "rollback")  # fmt: skip


_HEX = re.compile(r"[0-9a-f]{64}")


def _named(value: Any) -> bool:
    """A device id or model name as the fleet's names go (nothing else is printed)."""
    try:
        return isinstance(value, str) and bool(check_name(value, "name"))
    except OtaError:
        return False


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def valid(report: Any) -> bool:
    """Whether ``report`` has the shape the counts rely on."""
    if not isinstance(report, dict):
        return False
    model, version = report.get("model", ""), report.get("version", 0)
    result, state = report.get("result", ""), report.get("state", "")
    if not (isinstance(model, str) and _int(version) and isinstance(state, str)):
        return False
    if not isinstance(result, str) or not isinstance(report.get("time", 0), (int, float)):
        return False
    results = report.get("results", {})
    if not isinstance(results, dict):
        return False
    return all(
        isinstance(m, str) and isinstance(r, dict) and _int(r.get("version"))
        and isinstance(r.get("result"), str)
        for m, r in results.items()
    )  # fmt: skip


@dataclass
class Tally:
    """Devices' latest reports; pure bookkeeping (no I/O)."""

    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)  # when each device last reported
    malformed: int = 0
    unauthenticated: int = 0

    def add(self, device: str, report: dict[str, Any], now: float) -> None:
        t = report.get("time")
        sent = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else now
        self.reports[device] = report
        self.seen[device] = min(sent, now)  # a device clock ahead: when it arrived

    def _outcomes(self, r: dict[str, Any]) -> dict[tuple[str, str], str]:
        """(model, version) -> result this report states; "" for a job under way. The
        software's (``software.last``, ``software.job``) count under ``appliance``."""
        out: dict[tuple[str, str], str] = {}
        for model, last in (r.get("results") or {}).items():
            out[(model, str(int(last["version"])))] = str(last["result"])
        key = (str(r.get("model", "")), str(int(r.get("version", 0) or 0)))
        if key[0]:
            under_way = r.get("state") in UNDER_WAY and not r.get("result")
            if "results" not in r or under_way:  # an older agent's report, or a job
                out[key] = "" if under_way else str(r.get("result") or "")
        sw = r.get("software")
        for part in ("last", "job"):  # the job under way comes second: it is newer
            item = sw.get(part) if isinstance(sw, dict) else None
            if not isinstance(item, dict):
                continue
            version = item.get("version")
            if isinstance(version, str) and software.valid_version(version):
                out[(software.NAME, version)] = "" if part == "job" else str(item.get("result"))
        return out

    def counts(self, timeout_s: float, now: float) -> dict[tuple[str, str], Counter[str]]:
        out: dict[tuple[str, str], Counter[str]] = {}
        for device, r in self.reports.items():
            for key, result in self._outcomes(r).items():
                if result == "updated":
                    kind = "updated"
                elif result == "rolled_back":
                    kind = "rolled_back"
                elif result in FAILED:
                    kind = "failed"
                elif result:  # withdrawn: the fleet's own doing, never a failure
                    kind = "withdrawn"
                elif now - self.seen[device] > timeout_s:
                    kind = "failed"  # silent too long mid-update
                else:
                    kind = "pending"
                out.setdefault(key, Counter())[kind] += 1
        return out

    def devices(self, now: float) -> list[str]:
        """One line per device: the software it runs (version and the first 12 hex
        digits of its SBOM's SHA-256, as its report states them), the model versions it
        serves, and how long ago it reported. Reports are the devices' own words (signed
        when the watcher has their keys): every field is checked before it is shown."""
        lines = []
        for device in sorted(self.reports):
            r = self.reports[device]
            sw = r.get("software")
            sw = sw if isinstance(sw, dict) else {}
            version = sw.get("version")
            shown = version if isinstance(version, str) and software.valid_version(version) else "?"
            digest = sw.get("sbom_sha256")
            sbom = digest[:12] if isinstance(digest, str) and _HEX.fullmatch(digest) else "none"
            current = r.get("current")
            current = current if isinstance(current, dict) else {}
            models = ", ".join(
                f"{m} v{v}"
                for m, v in sorted(current.items())
                if _named(m) and _int(v)
            )
            ago = max(0.0, now - self.seen[device])
            lines.append(
                f"device {device if _named(device) else '?'}: software {shown} (SBOM {sbom}); "
                f"models {models or 'none'}; reported {ago:.0f} s ago"
            )
        return lines

    def shadow(self, model: str, version: int | str) -> str:
        """What the devices' shadow probations of ``model`` version ``version`` saw:
        per output the lowest top-1 agreement and the largest difference ("": none
        reported)."""
        devices, top1, diff = 0, dict[str, float](), dict[str, float]()
        for r in self.reports.values():
            summary = r.get("shadow")
            if (r.get("model"), str(r.get("version"))) != (model, str(version)) or not isinstance(
                summary, dict
            ):
                continue
            outputs = summary.get("outputs")
            devices += 1
            for name, o in (outputs if isinstance(outputs, dict) else {}).items():
                row: dict[str, Any] = o if isinstance(o, dict) else {}
                a, d = row.get("top1_agreement"), row.get("max_abs_diff")
                d = math.inf if d == "inf" else d
                if _number(a):
                    top1[str(name)] = min(top1.get(str(name), 1.0), float(a))
                if _number(d):
                    diff[str(name)] = max(diff.get(str(name), 0.0), float(d))
        if not devices:
            return ""
        parts = [f"{n} top-1 >= {v:.3f}" for n, v in sorted(top1.items())]
        parts += [f"{n} max diff {v:g}" for n, v in sorted(diff.items())]
        return f"; shadow on {devices} device(s): {', '.join(parts) or 'nothing compared'}"


def _order(item: tuple[tuple[str, str], Any]) -> tuple[str, tuple[int, ...]]:
    return item[0][0], software.version_key(item[0][1])


def _number(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def judged(counts: Counter[str]) -> int:
    """Devices whose reports on a version count towards its failure rate (a withdrawn
    job was the fleet's doing: it does not)."""
    return sum(n for kind, n in counts.items() if kind != "withdrawn")


def failing(counts: Counter[str], rate: float, min_reports: int) -> bool:
    total = judged(counts)
    bad = counts["failed"] + counts["rolled_back"]
    return total >= min_reports and bad / total > rate


class Keys:
    """The fleet's registered device keys: ``<dir>/<device_id>.pub``."""

    def __init__(self, folder: Path) -> None:
        if not folder.is_dir():
            raise OtaError(f"--device-keys: {folder} is not a folder")
        self.folder = folder
        self._cache: dict[str, Ed25519PublicKey | None] = {}

    def get(self, device: str) -> Ed25519PublicKey | None:
        if device not in self._cache:
            try:
                text = (self.folder / f"{check_name(device, 'device id')}.pub").read_text()
                self._cache[device] = devicekey.public_key(text)
            except (OSError, OtaError):
                self._cache[device] = None
        return self._cache[device]


def accept(tally: Tally, keys: Keys | None, topic: str, payload: bytes) -> None:
    """One received report into ``tally`` (or into its malformed / unauthenticated
    counts)."""
    parts = topic.split("/")
    device = parts[-2] if len(parts) >= 2 else ""
    try:
        report = json.loads(payload)
    except (ValueError, RecursionError):
        report = None
    if not device or not valid(report):
        tally.malformed += 1
        return
    if keys is not None:
        key = keys.get(device)
        earlier = tally.reports.get(device, {}).get("time", float("-inf"))
        if key is None or not devicekey.verify(report, key) or report.get("time", 0) < earlier:
            tally.unauthenticated += 1
            return
    tally.add(device, report, time.time())


def _line(model: str, version: int | str, c: Counter[str], min_reports: int) -> str:
    total = judged(c)
    line = (
        f"{model} v{version}: pending {c['pending']} updated {c['updated']} "
        f"failed {c['failed']} rolled back {c['rolled_back']}"
    )
    if c["withdrawn"]:
        line += f" withdrawn {c['withdrawn']}"
    if total < min_reports:
        line += f" (judged once {min_reports} devices reported: --min-reports; {total} so far)"
    return line


def main(args: argparse.Namespace, stop_after: int | None = None) -> int:
    """``fleet watch``. ``stop_after``: return once that many reports (skipped ones
    included) were read and judged, printing the counts then; MQTT has no end of the
    retained reports, so a test that knows how many it left stops on that, not on a
    time. ``--duration-s`` still bounds the wait."""
    host, _, port = args.mqtt.rpartition(":")
    if not host or not port.isdigit():
        raise OtaError(f"--mqtt: expected HOST:PORT, got {args.mqtt!r}")
    if (args.repo is None) != (args.keys is None):
        raise OtaError("--repo and --keys go together (both are needed to halt a rollout)")
    keys = Keys(Path(args.device_keys)) if args.device_keys else None
    print(
        f"watching {args.prefix}/+/ota: a version is halted once at least {args.min_reports} "
        f"devices reported on it (--min-reports) and more than {args.halt_at_failure_rate:g} "
        f"of them failed; reports {'must be signed' if keys else 'are not authenticated'}",
        flush=True,
    )
    inbox: queue.Queue[tuple[str, bytes]] = queue.Queue(maxsize=100_000)
    client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    if args.username:
        client.username_pw_set(args.username, args.password)
    client.on_connect = lambda c, *_: c.subscribe(f"{args.prefix}/+/ota", qos=1)

    def on_message(c: Any, u: Any, msg: Any) -> None:
        # when full, drop: the next report of that device carries its whole state again
        with contextlib.suppress(queue.Full):
            inbox.put_nowait((msg.topic, msg.payload))

    client.on_message = on_message
    client.connect(host, int(port))
    client.loop_start()
    tally, halted, last_print, last_skipped = Tally(), set(), 0.0, (0, 0)
    end = time.monotonic() + args.duration_s if args.duration_s else None
    read = 0
    try:
        while end is None or time.monotonic() < end:
            try:
                accept(tally, keys, *inbox.get(timeout=0.5))
                read += 1
                if not inbox.empty():
                    continue
            except queue.Empty:
                pass
            done = stop_after is not None and read >= stop_after
            counts = tally.counts(args.report_timeout_s, time.time())
            skipped = (tally.malformed, tally.unauthenticated)
            if done or time.monotonic() - last_print > 2 or skipped != last_skipped:
                last_print, last_skipped = time.monotonic(), skipped
                for (model, version), c in sorted(counts.items(), key=_order):
                    line = _line(model, version, c, args.min_reports)
                    print(line + tally.shadow(model, version), flush=True)
                if args.devices:
                    for line in tally.devices(time.time()):
                        print(line, flush=True)
                if any(skipped):
                    print(f"skipped: {skipped[0]} malformed report(s), {skipped[1]} "
                          "unauthenticated", flush=True)  # fmt: skip
            for (model, version), c in counts.items():
                if args.model and model != args.model:
                    continue
                key = f"{model}:{version}"
                if key in halted or not failing(c, args.halt_at_failure_rate, args.min_reports):
                    continue
                halted.add(key)
                print(_line(model, version, c, args.min_reports), flush=True)
                print(f"{model} v{version}: failure rate above {args.halt_at_failure_rate:g}; "
                      "halting the rollout", flush=True)  # fmt: skip
                if args.repo is not None:
                    where = (Path(args.repo), Path(args.keys))
                    controls.set_rollout(*where, model, version, halted=True)
                    print(f"{model} v{version}: rollout halted (targets re-signed)", flush=True)
            if done or (halted and args.exit_on_halt):
                return 0
    except KeyboardInterrupt:
        pass
    finally:
        client.disconnect()
        client.loop_stop()
    return 0
