"""``appliance fleet watch``: follow the devices' OTA reports, halt a failing rollout.

Subscribes to the retained ``<prefix>/+/ota`` reports and keeps each device's
latest one. Per model version it counts devices pending (under way), updated,
failed (refused or an error) and rolled back, plus devices silent for longer
than the report timeout after they started (counted as failed). Once at least
``min_reports`` devices reported on a version and the failed share exceeds the
threshold, the rollout is halted by re-signing the targets with ``halted: true``
(as hawkBit and AWS IoT Jobs stop a rollout on an error threshold).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from ota import OtaError, repo

FAILED = {"rolled_back", "refused", "error"}


@dataclass
class Tally:
    """Devices' latest reports; pure bookkeeping (no I/O)."""

    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)

    def add(self, device: str, report: dict[str, Any], now: float) -> None:
        self.reports[device] = report
        self.seen[device] = now

    def counts(self, timeout_s: float, now: float) -> dict[tuple[str, int], Counter[str]]:
        out: dict[tuple[str, int], Counter[str]] = {}
        for device, r in self.reports.items():
            key = (str(r.get("model", "")), int(r.get("version", 0) or 0))
            if not key[0]:
                continue
            result = str(r.get("result") or "")
            if result == "updated":
                kind = "updated"
            elif result == "rolled_back":
                kind = "rolled_back"
            elif result in FAILED:
                kind = "failed"
            elif now - self.seen[device] > timeout_s:
                kind = "failed"  # silent too long mid-update
            else:
                kind = "pending"
            out.setdefault(key, Counter())[kind] += 1
        return out


def failing(counts: Counter[str], rate: float, min_reports: int) -> bool:
    total = sum(counts.values())
    bad = counts["failed"] + counts["rolled_back"]
    return total >= min_reports and bad / total > rate


def main(args: argparse.Namespace) -> int:
    host, _, port = args.mqtt.rpartition(":")
    if not host or not port.isdigit():
        raise OtaError(f"--mqtt: expected HOST:PORT, got {args.mqtt!r}")
    if (args.repo is None) != (args.keys is None):
        raise OtaError("--repo and --keys go together (both are needed to halt a rollout)")
    inbox: queue.Queue[tuple[str, bytes]] = queue.Queue(maxsize=100_000)
    client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.on_connect = lambda c, *_: c.subscribe(f"{args.prefix}/+/ota", qos=1)

    def on_message(c: Any, u: Any, msg: Any) -> None:
        # when full, drop: the next report of that device carries its whole state again
        with contextlib.suppress(queue.Full):
            inbox.put_nowait((msg.topic, msg.payload))

    client.on_message = on_message
    client.connect(host, int(port))
    client.loop_start()
    tally, halted, last_print = Tally(), set(), 0.0
    end = time.monotonic() + args.duration_s if args.duration_s else None
    try:
        while end is None or time.monotonic() < end:
            try:
                topic, payload = inbox.get(timeout=0.5)
                report = json.loads(payload)
                if isinstance(report, dict):
                    tally.add(topic.split("/")[-2], report, time.time())
                continue_draining = not inbox.empty()
            except (queue.Empty, ValueError):
                continue_draining = False
            if continue_draining:
                continue
            counts = tally.counts(args.report_timeout_s, time.time())
            if time.monotonic() - last_print > 2:
                last_print = time.monotonic()
                for (model, version), c in sorted(counts.items()):
                    line = (
                        f"{model} v{version}: pending {c['pending']} updated {c['updated']} "
                        f"failed {c['failed']} rolled back {c['rolled_back']}"
                    )
                    print(line, flush=True)
            for (model, version), c in counts.items():
                if args.model and model != args.model:
                    continue
                key = f"{model}:{version}"
                if key in halted or not failing(c, args.halt_at_failure_rate, args.min_reports):
                    continue
                halted.add(key)
                print(f"{model} v{version}: failure rate above {args.halt_at_failure_rate:g}; "
                      "halting the rollout", flush=True)  # fmt: skip
                if args.repo is not None:
                    repo.set_rollout(Path(args.repo), Path(args.keys), model, version, halted=True)
                    print(f"{model} v{version}: rollout halted (targets re-signed)", flush=True)
            if halted and args.exit_on_halt:
                return 0
    except KeyboardInterrupt:
        pass
    finally:
        client.disconnect()
        client.loop_stop()
    return 0
