"""Probation: is the new version doing worse than allowed? A pure decision.

What counts (:class:`Counts`): the new version's statistics counted since probation
began (the switch promotes the copy that was self-tested, so the agent subtracts
what that copy had counted before) and the agent's own probes (the bundle's
self-test vectors, sent to the new version by version at each poll, each with
``probe_timeout_s`` to answer).

- Failures are the model's own: execution errors, timeouts and overload (5xx
  class), and probes that went unanswered or answered wrongly. Requests the
  server refused as the caller's fault (4xx: malformed, wrong shape, too large)
  are counted and reported apart but never held against the version: a client
  sending garbage must not roll back a good release.
- The error rate is failures over answered requests (a failure with nothing
  answered is a rate of 1).
- At the end, at least ``probation_min_requests`` requests must have been
  answered, or probation fails: a version nobody could reach is not committed.
- Latency is compared only once ten requests succeeded, so one slow first
  request does not condemn a version.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from appliance.ota.config import OtaConfig

MIN_REQUESTS_FOR_LATENCY = 10


@dataclass(slots=True)
class Counts:
    success: int = 0  # answered by the model (live traffic and probes)
    model_failures: int = 0  # failed by the model: 5xx class, in the server's statistics
    client_errors: int = 0  # refused as the caller's fault (4xx): not held against it
    probes: int = 0
    probe_failures: int = 0  # probes unanswered within probe_timeout_s, or answered wrong
    split: int = 1  # 0: the server's metrics page is off, so every failure is counted
    mean_ms: float = 0.0  # mean latency of the successful requests

    @property
    def answered(self) -> int:
        return self.success + self.model_failures

    @property
    def failures(self) -> int:
        return self.model_failures + self.probe_failures

    def to_json(self) -> dict[str, int]:
        doc = asdict(self)
        doc.pop("mean_ms")
        return {k: int(v) for k, v in doc.items()}

    def summary(self) -> str:
        clients = (
            f"{self.client_errors} refused as the client's fault (not counted)"
            if self.split
            else "the caller's faults not told apart (the server's metrics page is off)"
        )
        return (
            f"{self.answered} answered, {self.failures} failed "
            f"({self.model_failures} by the model, {self.probe_failures} of "
            f"{self.probes} probes), {clients}"
        )


def judge(c: Counts, old_ms: float, cfg: OtaConfig, final: bool = False) -> str:
    """Why the version fails probation, or "" while it passes. ``final``: probation's
    time is up, so the minimum of answered requests applies."""
    if c.failures and c.failures / max(c.answered, 1) > cfg.max_error_rate:
        rate = f"{c.failures}/{c.answered}"
        return f"error rate {rate} is above {cfg.max_error_rate:g}: {c.summary()}"
    mean = c.mean_ms
    if cfg.max_latency_ms and c.success and mean > cfg.max_latency_ms:
        return f"mean latency {mean:.1f} ms is above the {cfg.max_latency_ms:g} ms limit"
    ratio = cfg.max_latency_ratio
    if ratio and old_ms and c.success >= MIN_REQUESTS_FOR_LATENCY and mean > old_ms * ratio:
        return f"mean latency {mean:.1f} ms is over {ratio:g}x the old version's {old_ms:.1f} ms"
    if final and c.answered < cfg.probation_min_requests:
        return (
            f"only {c.answered} request(s) answered during probation, at least "
            f"{cfg.probation_min_requests} needed (probation_min_requests): {c.summary()}"
        )
    return ""
