"""The local appliance, as the agent sees it: its public HTTP API, nothing else.

Load and unload go through Triton's repository extension with the admin token;
statistics through the statistics extension (and, for the failures that were the
caller's fault, the metrics page); self-test vectors through ordinary
KServe v2 inference addressed by version. :class:`ServerGone` means the server
stopped answering (crashed or restarting), which the agent treats differently
from a refusal; :class:`ServerUnreachable`, its narrower case, that no connection
could be made at all: the request never reached the server, so nothing a candidate
did can have caused it (a server not started yet, or restarting).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import urllib3
from prometheus_client.parser import text_string_to_metric_families

from appliance.ota import OtaError


class ServerGone(OtaError):
    """The server did not answer (connection refused or dropped)."""


class ServerUnreachable(ServerGone):
    """No connection could be made: the request never reached the server."""


@dataclass(frozen=True, slots=True)
class VersionStats:
    success: int
    fail: int  # every failed request, the caller's faults included (Triton's count)
    success_ns: int
    client_errors: int = 0  # the part of ``fail`` that was the caller's fault (4xx)

    def mean_ms(self) -> float:
        return self.success_ns / self.success / 1e6 if self.success else 0.0

    @property
    def model_failures(self) -> int:
        """Failures of the model itself: execution errors, timeouts, overload."""
        return max(0, self.fail - self.client_errors)

    def counts(self) -> list[int]:
        return [self.success, self.fail, self.success_ns, self.client_errors]

    def since(self, before: VersionStats | None) -> VersionStats:
        """What was counted after ``before`` (all of it when ``before`` is None or came
        from another copy, whose counters were higher)."""
        if before is None or self.success < before.success or self.fail < before.fail:
            return self
        return VersionStats(
            self.success - before.success,
            self.fail - before.fail,
            self.success_ns - before.success_ns,
            max(0, self.client_errors - before.client_errors),
        )


CLIENT_ERRORS = "appliance_inference_request_client_error"


class ServerApi:
    def __init__(
        self, base_url: str, admin_token: str = "", timeout_s: float = 300.0, metrics_url: str = ""
    ) -> None:
        self.base = base_url.rstrip("/")
        self.metrics_url = metrics_url
        self._headers = {"Content-Type": "application/json"}
        if admin_token:
            self._headers["Authorization"] = f"Bearer {admin_token}"
        self._http = urllib3.PoolManager(maxsize=2)
        self._timeout = timeout_s

    def _call(self, method: str, path: str, body: Any = None, timeout_s: float = 0.0) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        try:
            r = self._http.request(
                method,
                self.base + path,
                body=data,
                headers=self._headers,
                timeout=timeout_s or self._timeout,
                retries=False,
            )
        except (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError):
            raise ServerUnreachable(f"the server at {self.base} cannot be reached") from None
        except urllib3.exceptions.HTTPError as exc:
            raise ServerGone(f"the server at {self.base} did not answer: {exc}") from None
        text = r.data.decode("utf-8", "replace")
        if r.status >= 400:
            try:
                message = json.loads(text).get("error", text)
            except (ValueError, AttributeError):
                message = text
            raise OtaError(f"{method} {path}: HTTP {r.status}: {message}")
        return json.loads(text) if text.strip() else None

    def live(self) -> bool:
        try:
            self._call("GET", "/v2/health/live")
        except OtaError:
            return False
        return True

    def wait_live(self, wait_s: float, alive: Callable[[], None]) -> None:
        """Return once the server answers; ServerUnreachable when it has not within
        ``wait_s``. Asks after 0.5 s, 1 s, 2 s, ... (at most 30 s apart), calling
        ``alive`` between asks (the agent's watchdog)."""
        deadline = time.monotonic() + wait_s
        pause = 0.5
        while not self.live():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerUnreachable(
                    f"the server at {self.base} did not answer within {wait_s:g}s"
                )
            alive()
            time.sleep(min(pause, left))
            pause = min(pause * 2, 30.0)

    def load(self, model: str, config: dict[str, Any], default_version: int = 0) -> None:
        """(Re)load ``model`` with ``config`` (Triton JSON) instead of its config file;
        unversioned requests go to ``default_version`` (0: the newest)."""
        params: dict[str, Any] = {"config": json.dumps(config)}
        if default_version:
            params["default_version"] = default_version
        self._call("POST", f"/v2/repository/models/{model}/load", {"parameters": params})

    def load_from_disk(self, model: str) -> None:
        self._call("POST", f"/v2/repository/models/{model}/load", {})

    def unload(self, model: str) -> None:
        self._call("POST", f"/v2/repository/models/{model}/unload", {})

    def start_shadow(self, model: str, params: dict[str, Any]) -> dict[str, Any]:
        """Mirror a sample of ``model``'s unversioned traffic to a loaded version
        (``params``: version, sample_rate, max_in_flight, max_requests); its report."""
        doc: dict[str, Any] = self._call(
            "POST", f"/v2/repository/models/{model}/shadow", {"parameters": params}
        )
        return doc

    def shadow_report(self, model: str) -> dict[str, Any]:
        doc: dict[str, Any] = self._call("GET", f"/v2/repository/models/{model}/shadow")
        return doc

    def ready_versions(self, model: str) -> list[int]:
        return sorted(v for v, state in self.version_states(model).items() if state == "READY")

    def version_states(self, model: str) -> dict[int, str]:
        """Each version of ``model`` the server knows, with its state (READY, LOADING,
        UNLOADING, UNAVAILABLE)."""
        rows = self._call("POST", "/v2/repository/index", {}) or []
        return {
            int(r["version"]): str(r.get("state", ""))
            for r in rows
            if r.get("name") == model and str(r.get("version", "")).isdigit()
        }

    def stats(self, model: str) -> dict[int, VersionStats]:
        doc = self._call("GET", f"/v2/models/{model}/stats")
        out = {}
        for row in doc.get("model_stats", []):
            s = row["inference_stats"]
            out[int(row["version"])] = VersionStats(
                int(s["success"]["count"]),
                int(s["fail"]["count"]),
                int(s["success"]["ns"]),
            )
        return out

    def client_errors(self, model: str) -> dict[int, int] | None:
        """Per version, the failures that were the caller's fault, from the server's
        metrics page (the statistics have Triton's schema exactly); None when the page is
        off or does not answer."""
        if not self.metrics_url:
            return None
        try:
            r = self._http.request("GET", self.metrics_url, timeout=self._timeout, retries=False)
        except urllib3.exceptions.HTTPError:
            return None
        if r.status != 200:
            return None
        out: dict[int, int] = {}
        try:
            for family in text_string_to_metric_families(r.data.decode("utf-8", "replace")):
                for sample in family.samples:
                    labels = sample.labels
                    if sample.name == CLIENT_ERRORS and labels.get("model") == model:
                        out[int(labels.get("version", "0"))] = int(sample.value)
        except ValueError:  # not a metrics page
            return None
        return out

    def infer(
        self, model: str, version: int, body: dict[str, Any], timeout_s: float = 0.0
    ) -> dict[str, Any]:
        result: dict[str, Any] = self._call(
            "POST", f"/v2/models/{model}/versions/{version}/infer", body, timeout_s
        )
        return result

    def memory_in_use(self) -> int:
        """Bytes every loaded model version holds, from the statistics."""
        doc = self._call("GET", "/v2/models/stats")
        return sum(
            int(m.get("byte_size", 0))
            for row in doc.get("model_stats", [])
            for m in row.get("memory_usage", [])
        )
