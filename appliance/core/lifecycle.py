"""Model lifecycle: which models and versions exist, their states, load, swap, unload.

A model loads as the set of versions its version policy selects. A (re)load is a
hot swap: the new copy is built completely (instances created within the memory
budget, warmed up) while the old copy keeps serving; then the routing table is
flipped in one assignment on the event loop, and the old copy drains its queued
and running requests in the background, unloads, and returns its memory to the
budget. A request is routed and queued in one step with no await in between, so
none can be lost between the two copies. If the new copy fails to load or warm,
the old one keeps serving and the error is reported.

If the budget cannot hold both copies, the load is refused unless the caller asks
for an in-place swap: the old copy stops taking requests (new ones get 503
UNAVAILABLE), drains what it queued, unloads, and then the new copy loads; if that
fails the old configuration is loaded again.

States follow Triton: LOADING, READY, UNLOADING, UNAVAILABLE (with the reason),
per version, in the repository index. Control modes: ``none`` and ``poll`` load
everything at start (``poll`` then applies what changes on disk, see
:mod:`appliance.core.repository`); ``explicit`` loads ``load_model`` at start and the
rest on request. All methods run on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import names
from appliance.config.fields import ConfigError
from appliance.config.model_config import ModelConfig, parse_model_config
from appliance.config.reader import load_model_config, with_labels
from appliance.config.server_config import ServerConfig
from appliance.core import loader, repository
from appliance.core.memory import BudgetRefused, MemoryBudget
from appliance.core.servable import Servable, State
from appliance.core.stats import LatencyWindow
from appliance.errors import ApplianceError, invalid, not_found, unavailable

log = logging.getLogger(__name__)

SWAP_HINT = (
    "; the old and the new copy must fit the budget together during a swap: unload "
    "another model, raise memory_limit, or load with the parameter in_place=true "
    "(the model is briefly unavailable while it is swapped)"
)


@dataclass(slots=True, eq=False)
class ModelEntry:
    """Everything known about one model name."""

    name: str
    versions: dict[int, Servable] = field(default_factory=dict)  # the routing table
    failed: dict[int, str] = field(default_factory=dict)  # version -> reason
    loading: set[int] = field(default_factory=set)  # versions being built right now
    retiring: list[Servable] = field(default_factory=list)  # old copies draining
    state: State = State.UNAVAILABLE
    reason: str = ""
    busy: str = ""  # "loading" or "unloading" while an operation holds the model
    unloaded: bool = False  # unloaded on request: not counted by server readiness
    # the version unversioned requests go to (0: the newest); set by a load's
    # ``default_version`` so a candidate can be loaded and tested by version while
    # the old one keeps the default traffic (the OTA agent's self-test)
    default: int = 0

    def newest(self) -> Servable | None:
        return self.versions[max(self.versions)] if self.versions else None


class ModelLifeCycle:
    """Owns every servable version and the memory budget; all methods run on the event loop."""

    def __init__(self, repository_dir: Path, server: ServerConfig) -> None:
        self.repository = repository_dir
        self.server = server
        self.budget = MemoryBudget(server.memory_limit)
        self._models: dict[str, ModelEntry] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._retired: set[asyncio.Task[None]] = set()
        self._poller: repository.RepositoryPoller | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._started = False  # the server is not ready before the start-up loads ran

    def names(self) -> list[str]:
        return repository.model_names(self.repository)

    async def start(self) -> None:
        """Load what the control mode loads at start, one model after another (a small
        device has few cores; loading in parallel would only slow the models already
        serving), then start watching the repository in ``poll`` mode."""
        names = self.names()
        wanted = self.server.load_model
        if self.server.model_control_mode == "explicit" and "*" not in wanted:
            missing = [n for n in wanted if n not in names]
            if missing:
                raise ConfigError(
                    "<server>", "load_model", f"no such model(s) in {self.repository}: {missing}"
                )
            names = [n for n in names if n in wanted]
        poll = self.server.model_control_mode == "poll"
        if poll:  # before loading: a change made while loading is seen by the first poll
            baseline = await asyncio.to_thread(repository.snapshot, self.repository)
        # ensembles last: their validation needs the step models loaded
        names.sort(key=self._loads_late)
        for name in names:
            await self.load(name)
        self._started = True
        if poll:
            self._poller = repository.RepositoryPoller(baseline)
            self._poll_task = asyncio.get_running_loop().create_task(
                self._poll_forever(), name="repository-poll"
            )

    def _loads_late(self, name: str) -> bool:
        try:
            model_dir = names.model_dir(self.repository, name, self.server.allow_symlinked_models)
            return loader.loads_after_others(load_model_config(model_dir))
        except ApplianceError:
            return False  # reported when it loads

    async def load(
        self,
        name: str,
        override: dict[str, Any] | None = None,
        in_place: bool = False,
        default_version: int = 0,
    ) -> ModelEntry:
        """(Re)load ``name``: see the module docstring. ``override`` is a config mapping
        used instead of the repository's config file (the load request's ``config``).
        ``default_version``: the loaded version that takes unversioned requests from
        the flip on (0, or a version that did not load: the newest).

        Never raises for a bad model or a refused load: the failure is logged and
        recorded as the model's reason, and whatever served before keeps serving.
        Raises INVALID_ARG for a name that is not a model name (:mod:`appliance.names`)
        and NOT_FOUND when the repository has no such model folder; a folder that
        links outside the repository is a failed load.
        """
        names.check_model_name(name)
        model_dir = self.repository / name
        if not model_dir.is_dir():
            raise not_found(
                f"failed to load '{name}', failed to poll from model repository: "
                f"model '{name}' is not in the model repository"
            )
        async with self._locks.setdefault(name, asyncio.Lock()):
            entry = self._models.setdefault(name, ModelEntry(name))
            entry.busy, entry.unloaded = "loading", False
            try:
                await self._load(entry, model_dir, override, in_place, default_version)
            finally:
                entry.busy, entry.loading = "", set()
            return entry

    async def _load(
        self,
        entry: ModelEntry,
        model_dir: Path,
        override: dict[str, Any] | None,
        in_place: bool,
        default_version: int,
    ) -> None:
        name = entry.name
        allow = self.server.allow_symlinked_models
        try:
            names.confine(self.repository, model_dir, allow, f"the folder of model '{name}'")
            if override is not None:
                config = with_labels(
                    parse_model_config(override, name, "load request parameter 'config'"),
                    model_dir,
                )
            else:
                config = load_model_config(model_dir)
            wanted = config.version_policy.select(repository.version_dirs(model_dir))
            if not wanted:
                raise not_found(
                    f"model '{name}' has no version folder that its version policy serves "
                    f"in {model_dir}"
                )
            for v in wanted:
                names.confine(
                    self.repository, model_dir / str(v), allow, f"model '{name}' version {v}"
                )
        except ApplianceError as exc:
            self._failed(entry, str(exc))
            return
        old = dict(entry.versions)
        entry.loading = set(wanted)
        if not old:
            entry.state = State.LOADING
        if old and in_place:
            await self._take_down(entry)
        elif old:
            refusal = self.budget.swap_shortfall(config.name, wanted, config.instance_count)
            if refusal:
                self._failed(entry, refusal + SWAP_HINT)
                return
        required = {}
        if old and not in_place:  # a swap never leaves fewer instances than it replaces
            newest = old[max(old)].stats.instances
            for v in wanted:
                have = old[v].stats.instances if v in old else newest
                required[v] = min(config.instance_count, have)
        new, failed = await self._build(config, model_dir, wanted, required)
        if in_place and old and not new:
            log.error("model '%s': the in-place swap failed; loading the old copy again", name)
            restored, _ = await self._build_each(model_dir, old)
            new = restored
        if in_place:
            keep: dict[int, Servable] = {}  # already unloaded by _take_down
        elif not new:
            keep = old  # nothing new loaded: everything stays as it was
        else:
            keep = {v: mv for v, mv in old.items() if v in failed}
        routing = {**keep, **new}
        if new:  # a load that changed nothing keeps the routing it had
            entry.default = default_version if default_version in routing else 0
        entry.versions = routing  # the flip: the next request goes to the new copy
        entry.failed = {v: r for v, r in failed.items() if v not in routing}
        entry.state = State.READY if routing else State.UNAVAILABLE
        entry.reason = "; ".join(f"version {v}: {r}" for v, r in sorted(failed.items()))
        if not in_place:
            for v, mv in old.items():
                if routing.get(v) is not mv:
                    self._retire(entry, mv)

    async def _build(
        self, config: ModelConfig, model_dir: Path, wanted: list[int], required: dict[int, int]
    ) -> tuple[dict[int, Servable], dict[int, str]]:
        new: dict[int, Servable] = {}
        failed: dict[int, str] = {}
        for version in wanted:
            try:
                new[version] = await loader.load(
                    config,
                    model_dir / str(version),
                    self.server,
                    self.budget,
                    required.get(version, 1),
                    self.get,
                )
                if self.server.metrics_summary_latencies:
                    new[version].stats.latencies = LatencyWindow()
            except Exception as exc:  # one bad version must not stop the others
                swap = isinstance(exc, BudgetRefused) and bool(required)
                message = str(exc) + (SWAP_HINT if swap else "")
                failed[version] = message
                log.error("model '%s' version %d failed to load: %s", config.name, version, message)
        return new, failed

    async def _build_each(
        self, model_dir: Path, previous: dict[int, Servable]
    ) -> tuple[dict[int, Servable], dict[int, str]]:
        """Load each version again with the config it had."""
        new: dict[int, Servable] = {}
        failed: dict[int, str] = {}
        for v, mv in previous.items():
            built, errors = await self._build(mv.config, model_dir, [v], {})
            new.update(built)
            failed.update(errors)
        return new, failed

    async def _take_down(self, entry: ModelEntry) -> None:
        """In-place swap, first half: stop routing to the old copy, let it finish what
        it queued, unload it."""
        old, entry.versions = entry.versions, {}
        entry.state, entry.reason = State.LOADING, "in-place swap: the old copy is unloading"
        entry.retiring.extend(old.values())
        try:
            await asyncio.gather(*(mv.unload(self.server.drain_timeout_s) for mv in old.values()))
        finally:
            for mv in old.values():
                entry.retiring.remove(mv)

    def _failed(self, entry: ModelEntry, reason: str) -> None:
        entry.reason = reason
        log.error("model '%s' failed to load: %s", entry.name, reason)
        if not entry.versions:
            entry.state = State.UNAVAILABLE

    def _retire(self, entry: ModelEntry, mv: Servable) -> None:
        entry.retiring.append(mv)
        task = asyncio.get_running_loop().create_task(self._unload_retired(entry, mv))
        self._retired.add(task)  # keep a hard reference until it finishes
        task.add_done_callback(self._retired.discard)

    async def _unload_retired(self, entry: ModelEntry, mv: Servable) -> None:
        try:
            await mv.unload(self.server.drain_timeout_s)
        finally:
            entry.retiring.remove(mv)

    async def unload(self, name: str) -> None:
        """Stop routing to ``name``, drain its versions and free them. INVALID_ARG while
        the model is being loaded or unloaded; NOT_FOUND for a model never loaded."""
        entry = self._models.get(name)
        if entry is None:
            raise not_found(f"model '{name}' is not loaded")
        if entry.busy:
            raise invalid(
                f"model '{name}' is {entry.busy} right now; unload it once that has finished"
            )
        async with self._locks.setdefault(name, asyncio.Lock()):
            entry.busy = "unloading"
            old, entry.versions = entry.versions, {}
            entry.state, entry.reason, entry.failed = State.UNAVAILABLE, "unloaded", {}
            entry.unloaded = True
            entry.retiring.extend(old.values())
            try:
                await asyncio.gather(
                    *(mv.unload(self.server.drain_timeout_s) for mv in old.values())
                )
            finally:
                entry.busy = ""
                for mv in old.values():
                    entry.retiring.remove(mv)

    # ---- poll mode ----------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.server.repository_poll_secs)
            try:
                await self.poll()
            except Exception:  # a bad poll must not end polling
                log.exception("polling the model repository failed")

    async def poll(self) -> None:
        """Apply what changed in the repository since the last poll (``poll`` mode)."""
        if self._poller is None:
            return
        current = await asyncio.to_thread(repository.snapshot, self.repository)
        to_load, to_unload = self._poller.changes(current)
        for name in to_unload:
            entry = self._models.get(name)
            if entry is not None and entry.busy:
                continue  # next poll
            log.info("model '%s' left the repository: unloading it", name)
            if entry is not None:
                await self.unload(name)
                self._models.pop(name, None)
            self._poller.forget(name)
        for name in sorted(to_load, key=self._loads_late):  # ensembles after their steps
            log.info("model '%s' changed in the repository: loading it", name)
            self._poller.applied(name, current[name])
            try:
                await self.load(name)
            except ApplianceError as exc:  # e.g. the folder vanished meanwhile
                log.error("model '%s': %s", name, exc)

    # ---- routing and reporting ------------------------------------------------------------

    def get(self, name: str, version: str = "") -> Servable:
        """The version that serves a request, or Triton's error for it: INVALID_ARG for
        an unknown model or a version string that is not a number, NOT_FOUND for a
        version the model lacks, UNAVAILABLE for one not ready."""
        entry = self.entry(name)
        if not version:
            mv = entry.versions.get(entry.default) or entry.newest()
            if mv is None:
                raise unavailable(
                    f"Request for unknown model: '{name}' has no available versions: it is "
                    f"not ready ({entry.state.value}"
                    f"{': ' + entry.reason if entry.reason else ''})"
                )
            return mv
        number = int(names.check_version(version))
        mv = entry.versions.get(number)
        if mv is None:
            if number in entry.failed:
                raise unavailable(
                    f"Request for unknown model: '{name}' version {number} is not ready: "
                    f"{entry.failed[number]}"
                )
            if number in entry.loading:
                raise unavailable(
                    f"Request for unknown model: '{name}' version {number} is not ready (loading)"
                )
            raise not_found(f"Request for unknown model: '{name}' version {number} is not found")
        return mv

    def entry(self, name: str) -> ModelEntry:
        entry = self._models.get(name)
        if entry is None:
            raise invalid(f"Request for unknown model: '{name}' is not found")
        return entry

    def loaded(self) -> list[Servable]:
        return [mv for e in self._models.values() for mv in e.versions.values()]

    def all_ready(self) -> bool:
        return self._started and all(
            e.state == State.READY for e in self._models.values() if not e.unloaded
        )

    def index(self) -> list[dict[str, Any]]:
        """Triton's repository index: one row per model version (or per model with none).

        A version being built shows LOADING, an old copy still draining UNLOADING
        (unless the same version number already serves again), a failed one
        UNAVAILABLE with its reason.
        """
        rows: list[dict[str, Any]] = []
        for name in self.names():
            entry = self._models.get(name)
            if entry is None:
                rows.append({"name": name})
                continue
            states: dict[int, tuple[str, str]] = {}
            for v, reason in entry.failed.items():
                states[v] = ("UNAVAILABLE", reason)
            for mv in entry.retiring:
                states[mv.version] = (State.UNLOADING.value, "")
            for v in entry.loading:
                states[v] = (State.LOADING.value, "")
            for v, mv in entry.versions.items():
                states[v] = (mv.state.value, "")
            for v, (state, reason) in sorted(states.items()):
                rows.append({"name": name, "version": str(v), "state": state, "reason": reason})
            if not states:
                rows.append({"name": name, "state": entry.state.value, "reason": entry.reason})
        return rows

    async def stop(self, timeout_s: float) -> None:
        """Stop polling, then drain and unload everything (used at shutdown)."""
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
            self._poll_task = None
        versions = self.loaded()
        for entry in self._models.values():
            entry.versions, entry.state = {}, State.UNAVAILABLE
        await asyncio.gather(*(mv.unload(timeout_s) for mv in versions), return_exceptions=True)
        if self._retired:
            await asyncio.gather(*self._retired, return_exceptions=True)
