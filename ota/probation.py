"""Probation: is the new version doing worse than allowed? A pure decision.

Called with the new version's statistics counted since probation began (the
switch promotes the copy that was self-tested, so the agent subtracts what that
copy had counted before) and the old version's mean latency; returns why it
fails, or "" while it passes. Latency is compared only once ten requests
succeeded, so one slow first request does not condemn a version.
"""

from __future__ import annotations

from ota.config import OtaConfig
from ota.server_api import VersionStats

MIN_REQUESTS_FOR_LATENCY = 10


def judge(stats: VersionStats, old_ms: float, cfg: OtaConfig) -> str:
    total = stats.success + stats.fail
    if total and stats.fail / total > cfg.max_error_rate:
        return f"error rate {stats.fail}/{total} is above {cfg.max_error_rate:g}"
    mean = stats.mean_ms()
    if cfg.max_latency_ms and stats.success and mean > cfg.max_latency_ms:
        return f"mean latency {mean:.1f} ms is above the {cfg.max_latency_ms:g} ms limit"
    ratio = cfg.max_latency_ratio
    if ratio and old_ms and stats.success >= MIN_REQUESTS_FOR_LATENCY and mean > old_ms * ratio:
        return f"mean latency {mean:.1f} ms is over {ratio:g}x the old version's {old_ms:.1f} ms"
    return ""
