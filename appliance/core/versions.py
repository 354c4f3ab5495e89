"""One record per model version, as Triton's model lifecycle keeps them.

A :class:`ModelEntry` holds everything known about one model name: one
:class:`VersionRecord` per version the lifecycle knows of (serving, being built,
draining an old copy, or failed with its reason), the version unversioned requests
go to, and the model-level reason of the last load. The routing table requests read
(:attr:`ModelEntry.versions`) is derived from the records by :meth:`ModelEntry.flip`,
one assignment on the event loop. Pure bookkeeping, no I/O and no awaits: the
operations (load, swap, drain, unload) are :mod:`appliance.core.lifecycle`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from appliance.config.model_config import ModelConfig, VersionPolicy
from appliance.core import shadow
from appliance.core.repository import Fingerprint
from appliance.core.servable import Servable, State
from appliance.core.shadow import Shadow
from appliance.errors import ApplianceError, invalid, not_found, unavailable


def comparable(config: ModelConfig) -> ModelConfig:
    """``config`` without what does not change a built copy: which versions the load
    named, and where the config was read from."""
    return replace(config, version_policy=VersionPolicy(), source="")


@dataclass(slots=True, eq=False)
class VersionRecord:
    """One version of one model: the copy that serves it, the config and files that
    copy was built from, a build under way, old copies still finishing their in-flight
    requests, and why the last build failed."""

    version: int
    serving: Servable | None = None  # the copy requests are routed to
    source: ModelConfig | None = None  # the config ``serving`` was built from
    files: Fingerprint | None = None  # what the version's files were when it was built
    loading: bool = False  # a new copy is being built
    reason: str = ""  # why the last build failed ("" when it did not)
    draining: list[Servable] = field(default_factory=list)  # old copies, unloading

    @property
    def state(self) -> State:
        """Triton's state of this version: the serving copy's, else LOADING while a copy
        is built, UNLOADING while an old one drains, UNAVAILABLE (with ``reason``)."""
        if self.serving is not None:
            return self.serving.state
        if self.loading:
            return State.LOADING
        if self.draining:
            return State.UNLOADING
        return State.UNAVAILABLE

    @property
    def idle(self) -> bool:
        """Nothing left to report: no copy, no build, no drain, no failure."""
        return self.serving is None and not self.loading and not self.draining and not self.reason

    def keeps(self, config: ModelConfig, files: Fingerprint | None) -> bool:
        """Whether the serving copy is what building ``config`` over ``files`` would give,
        so a load keeps it instead of building it again: a READY copy built from the
        same config (apart from the version policy) and the same files. Triton also
        leaves a model whose repository did not change as it is on a load request."""
        serving, source = self.serving, self.source
        if serving is None or source is None or files is None or files != self.files:
            return False
        return serving.ready and comparable(config) == comparable(source)


@dataclass(slots=True, eq=False)
class ModelEntry:
    """Everything known about one model name."""

    name: str
    records: dict[int, VersionRecord] = field(default_factory=dict)
    # the routing table, derived from the records by flip(): version -> serving copy
    versions: dict[int, Servable] = field(default_factory=dict)
    reason: str = ""  # why the last load failed, or "unloaded"
    busy: str = ""  # "loading" or "unloading" while an operation holds the model
    unloaded: bool = False  # unloaded on request: not counted by server readiness
    # the version unversioned requests go to (0: the newest); set by a load's
    # ``default_version`` so a candidate can be loaded and tested by version while
    # the old one keeps the default traffic (the OTA agent's self-test)
    default: int = 0
    # unversioned requests go here: the default version's copy, else the newest (or
    # the shadow wrapping it while its traffic is mirrored to a candidate)
    routed: Servable | None = None
    shadow: Shadow | None = None  # the last shadow traffic started (core/shadow.py)
    # the config mapping of the last load request that gave one (None: the
    # repository's): what a recovery (core/recovery.py) loads the model with again
    override: dict[str, Any] | None = None

    @property
    def state(self) -> State:
        """READY while a version serves; LOADING while the first copy is built (or an
        in-place swap has taken the old one down); UNAVAILABLE otherwise."""
        if self.versions:
            return State.READY
        if any(r.loading for r in self.records.values()):
            return State.LOADING
        return State.UNAVAILABLE

    def record(self, version: int) -> VersionRecord:
        return self.records.setdefault(version, VersionRecord(version))

    def flip(self) -> None:
        """Route to what the records serve now, in one assignment each. Every change
        of the model goes through here, and ends its shadow traffic."""
        if self.shadow is not None:
            self.shadow.active = False
        routing = {v: r.serving for v, r in sorted(self.records.items()) if r.serving}
        if self.default not in routing:
            self.default = 0
        self.versions = routing
        self.routed = routing.get(self.default) or (routing[max(routing)] if routing else None)

    def mirror(self, params: dict[str, Any]) -> dict[str, Any]:
        """Mirror a sample of the unversioned traffic to the loaded version
        ``params["version"]`` (:mod:`appliance.core.shadow`); its first report."""
        if self.busy:
            raise invalid(f"model '{self.name}' is {self.busy} right now")
        number = params.get("version")
        if isinstance(number, str) and number.isdigit():
            number = int(number)
        candidate = self.versions.get(number) if isinstance(number, int) else None
        serving = self.routed.serving if isinstance(self.routed, Shadow) else self.routed
        if candidate is None or serving is None:
            raise invalid(
                f"shadow parameter 'version' must name a loaded version of model "
                f"'{self.name}' ({sorted(self.versions)}), got {number!r}"
            )
        if self.shadow is not None:
            self.shadow.active = False
        self.shadow = shadow.start(serving, candidate, params)
        self.routed = self.shadow
        return self.shadow.report()

    def prune(self) -> None:
        """Forget records with nothing left to report."""
        for v in [v for v, r in self.records.items() if r.idle]:
            del self.records[v]

    def draining(self) -> bool:
        """Whether an old copy of any version is still unloading."""
        return any(r.draining for r in self.records.values())

    def not_serving(self, version: int) -> ApplianceError:
        """Triton's error for a request to ``version`` when no copy serves it."""
        record = self.records.get(version)
        prefix = f"Request for unknown model: '{self.name}' version {version}"
        if record is not None and record.loading:
            return unavailable(f"{prefix} is not ready (loading)")
        if record is not None and record.reason:
            return unavailable(f"{prefix} is not ready: {record.reason}")
        return not_found(f"{prefix} is not found")

    def rows(self) -> list[dict[str, Any]]:
        """The model's rows of Triton's repository index: one per version, with its state
        (a version serving shows its copy's, READY while a new copy builds or an old one
        drains) and, when it failed, the reason; one for the model when it has none."""
        if not self.records:
            return [{"name": self.name, "state": self.state.value, "reason": self.reason}]
        rows = []
        for v, r in sorted(self.records.items()):
            state = r.state
            reason = r.reason if state is State.UNAVAILABLE and r.serving is None else ""
            rows.append(
                {"name": self.name, "version": str(v), "state": state.value, "reason": reason}
            )
        return rows
