"""Shadow probation: before the switch, live traffic mirrored to the candidate and its
outputs judged against the bundle's thresholds. Health checks ask whether a model
answers; this asks whether it answers what the serving version would.

A bundle's manifest may carry a ``shadow`` policy (``appliance bundle build --shadow
POLICY.json``)::

    {"requests": 50, "sample_rate": 0.2, "max_in_flight": 1, "timeout_s": 600,
     "required": false, "max_failures": 0,
     "outputs": {"probs": {"min_top1_agreement": 0.98},
                 "boxes": {"max_abs_diff": 0.05}}}

After the self-test the agent starts the server's shadow traffic (a sample of the
unversioned requests, which the serving version answers as always, sent again to
the candidate: :mod:`appliance.core.shadow`) and reads its report until
``requests`` comparisons were made or ``timeout_s`` passed. :func:`judge` refuses
the candidate (rolled back and marked bad, like a failed self-test) when an output
named in ``outputs`` agrees on the top-1 class less often than
``min_top1_agreement`` or differs by more than ``max_abs_diff`` anywhere, when any
output differed in shape or datatype, or when the candidate failed more than
``max_failures`` mirrored requests (a difference, a mismatch or a failure refuses at
once; the agreement is judged when the comparison ends). Too little traffic before
``timeout_s`` lets the update go on (the report says so) unless the policy is
``required``. The summary goes to the fleet in the device's reports.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from appliance.ota import OtaError
from appliance.ota.rollout import check_name
from appliance.ota.server_api import ServerApi

_KEYS = {"requests", "sample_rate", "max_in_flight", "timeout_s", "required", "max_failures",
         "outputs"}  # fmt: skip
_RULES = {"min_top1_agreement", "max_abs_diff"}


@dataclass(frozen=True, slots=True)
class OutputRule:
    min_top1_agreement: float | None = None  # share of rows, 0..1
    max_abs_diff: float | None = None


@dataclass(frozen=True, slots=True)
class Policy:
    requests: int = 50
    sample_rate: float = 0.1
    max_in_flight: int = 1
    timeout_s: float = 600.0
    required: bool = False
    max_failures: int = 0
    outputs: dict[str, OutputRule] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        outputs = {
            name: {k: v for k, v in (("min_top1_agreement", r.min_top1_agreement),
                                     ("max_abs_diff", r.max_abs_diff)) if v is not None}
            for name, r in self.outputs.items()
        }  # fmt: skip
        return {
            "requests": self.requests, "sample_rate": self.sample_rate,
            "max_in_flight": self.max_in_flight, "timeout_s": self.timeout_s,
            "required": self.required, "max_failures": self.max_failures, "outputs": outputs,
        }  # fmt: skip


def _number(raw: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = raw.get(key, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not low <= value <= high:
        raise OtaError(f"shadow policy: '{key}' must be a number in [{low:g}, {high:g}]")
    return float(value)


def parse(raw: Any) -> Policy | None:
    """A manifest's ``shadow`` field (None: no shadow probation); OtaError naming the
    first bad field."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise OtaError("shadow policy: expected an object")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise OtaError(f"shadow policy: unknown field(s) {unknown}, expected {sorted(_KEYS)}")
    required = raw.get("required", False)
    if not isinstance(required, bool):
        raise OtaError("shadow policy: 'required' must be true or false")
    outputs_raw = raw.get("outputs", {})
    if not isinstance(outputs_raw, dict) or len(outputs_raw) > 64:
        raise OtaError("shadow policy: 'outputs' must map at most 64 output names to rules")
    outputs = {}
    for name, rule in outputs_raw.items():
        check_name(str(name), "shadow policy output name")
        if not isinstance(rule, dict) or not rule or set(rule) - _RULES:
            raise OtaError(
                f"shadow policy: outputs.{name} must set min_top1_agreement and/or max_abs_diff"
            )
        top1 = (
            _number(rule, "min_top1_agreement", 0, 0, 1) if "min_top1_agreement" in rule else None
        )
        diff = _number(rule, "max_abs_diff", 0, 0, 1e30) if "max_abs_diff" in rule else None
        outputs[str(name)] = OutputRule(top1, diff)
    return Policy(
        int(_number(raw, "requests", 50, 1, 100_000)),
        _number(raw, "sample_rate", 0.1, 1e-6, 1),
        int(_number(raw, "max_in_flight", 1, 1, 16)),
        _number(raw, "timeout_s", 600, 1, 7 * 86400),
        required,
        int(_number(raw, "max_failures", 0, 0, 100_000)),
        outputs,
    )


def judge(report: dict[str, Any], policy: Policy, final: bool) -> str:
    """Why the candidate is refused on this report ("" while it passes; with
    ``final`` the comparison is over, so too little traffic counts when required)."""
    failed = int(report.get("failed", 0))
    if failed > policy.max_failures:
        return f"the candidate failed {failed} mirrored request(s) (at most {policy.max_failures})"
    outputs = report.get("outputs", {})
    for name, agreement in sorted(outputs.items()):
        if int(agreement.get("mismatched", 0)):
            return (
                f"output '{name}' differed in shape or datatype {agreement['mismatched']} time(s)"
            )
    for name, rule in sorted(policy.outputs.items()):
        agreement = outputs.get(name)
        if agreement is None:
            continue  # nothing compared yet
        rows = int(agreement.get("rows", 0))
        if rule.min_top1_agreement is not None and rows:
            share = int(agreement.get("top1_agree", 0)) / rows
            if final and share < rule.min_top1_agreement:  # a share can still rise until then
                return (
                    f"output '{name}': top-1 agreement {share:.3f} over {rows} row(s) is below "
                    f"{rule.min_top1_agreement:g}"
                )
        worst = agreement.get("max_abs_diff", 0.0)
        worst = math.inf if worst == "inf" else float(worst)
        if rule.max_abs_diff is not None and worst > rule.max_abs_diff:
            return f"output '{name}': max abs diff {worst:g} is above {rule.max_abs_diff:g}"
    compared = int(report.get("compared", 0))
    if final and policy.required and compared < policy.requests:
        return f"only {compared} of {policy.requests} required request(s) were compared"
    return ""


def summary(report: dict[str, Any], verdict: str) -> dict[str, Any]:
    """What the device reports to the fleet about its shadow probation."""
    outputs = {}
    for name, a in sorted(report.get("outputs", {}).items()):
        rows = int(a.get("rows", 0))
        outputs[name] = {
            "rows": rows,
            "top1_agreement": round(int(a.get("top1_agree", 0)) / rows, 6) if rows else None,
            "max_abs_diff": a.get("max_abs_diff"),
        }
    return {
        "compared": int(report.get("compared", 0)),
        "failed": int(report.get("failed", 0)),
        "outputs": outputs,
        "verdict": verdict or "passed",
    }


def run(
    api: ServerApi,
    model: str,
    version: int,
    policy: Policy,
    poll_s: float,
    alive: Callable[[], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[str, dict[str, Any]]:
    """Mirror traffic to ``version`` of ``model`` and judge it: (why it is refused, or
    "", and the summary for the fleet)."""
    params = {
        "version": version,
        "sample_rate": policy.sample_rate,
        "max_in_flight": policy.max_in_flight,
        "max_requests": policy.requests,
    }
    report = api.start_shadow(model, params)
    deadline = clock() + policy.timeout_s
    while True:
        final = int(report.get("compared", 0)) >= policy.requests or clock() >= deadline
        verdict = judge(report, policy, final)
        if verdict or final:
            out = summary(report, verdict)
            compared = out["compared"]
            if not verdict and compared < policy.requests:
                out["verdict"] = f"passed on {compared} of {policy.requests} (too little traffic)"
            return verdict, out
        alive()
        sleep(min(poll_s, max(0.0, deadline - clock())))
        report = api.shadow_report(model)
