"""Model lifecycle: which models and versions exist, their states, load, swap, unload.

As in Triton's model lifecycle, each model keeps one record per version
(:mod:`appliance.core.versions`): the copy serving it, the config and files it was
built from, a build under way, old copies draining, the reason of a failure. A
(re)load plans per version: a version whose serving copy was built from the same
config (apart from the version policy) and the same files is kept as it is (so a
load that only drops a version, or promotes a candidate loaded next to the old
version, builds nothing); every other wanted version gets a new copy, built
completely (instances created within the memory budget, warmed up) while the old
copy keeps serving. Then the routing table is flipped in one assignment on the
event loop, and every copy that no longer serves drains its queued and running
requests, unloads, and returns its memory to the budget: one drain path for swaps,
unloads and shutdown. A request is routed and queued in one step with no await in
between, so none can be lost between two copies. If no new copy loads, everything
stays as it was and the error is reported.

If the budget cannot hold the old and the new copy together, the load is refused
unless the caller asks for an in-place swap: the copies to be replaced are drained
and unloaded first (their versions answer 503 UNAVAILABLE meanwhile), then the new
copies load; if none does, the replaced versions are built again with their own
configs.

States follow Triton: LOADING, READY, UNLOADING, UNAVAILABLE (with the reason),
per version, in the repository index. Control modes: ``none`` and ``poll`` load
everything at start (``poll`` then applies what changes on disk, see
:mod:`appliance.core.repository`); ``explicit`` loads ``load_model`` at start and the
rest on request. All methods run on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from appliance import heap, names
from appliance.config.fields import ConfigError
from appliance.config.model_config import ModelConfig
from appliance.config.server_config import ServerConfig
from appliance.core import loader, polling, rate_limiter, recovery, repository
from appliance.core.memory import BudgetRefused, MemoryBudget, Usage
from appliance.core.model import ModelVersion
from appliance.core.response_cache import ResponseCache
from appliance.core.servable import Servable, State
from appliance.core.stats import LatencyWindow
from appliance.core.versions import ModelEntry, VersionRecord
from appliance.errors import ApplianceError, invalid, not_found, unavailable

log = logging.getLogger(__name__)

SWAP_HINT = (
    "; the old and the new copy must fit the budget together during a swap: unload "
    "another model, raise memory_limit, or load with the parameter in_place=true "
    "(the model is briefly unavailable while it is swapped)"
)


class ModelLifeCycle:
    """Owns every servable version and the memory budget; all methods run on the event loop."""

    def __init__(self, repository_dir: Path, server: ServerConfig) -> None:
        self.repository = repository_dir
        self.server = server
        self.budget = MemoryBudget(server.memory_limit)
        # Triton's rate limiter, shared by every model (None: rate_limit off)
        self.limiter = rate_limiter.from_settings(server.rate_limit, server.rate_limit_resources)
        # Triton's response cache, for models whose config enables it; its size is
        # charged to the memory budget for as long as the server runs
        self.cache: ResponseCache | None = None
        if server.response_cache_size:
            self.cache = ResponseCache(server.response_cache_size)
            self.budget.charge(
                self.cache, "<response cache>", Usage(cpu=server.response_cache_size)
            )
        self._models: dict[str, ModelEntry] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._retired: set[asyncio.Task[None]] = set()
        self._poller: repository.RepositoryPoller | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._recovery = recovery.Recovery()
        self._recover_task: asyncio.Task[None] | None = None
        self._started = False  # the server is not ready before the start-up loads ran
        self._stopping = False

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
        for name in self.load_order(names):
            await self.load(name)
        self._started = True
        heap.settle()  # what start-up loaded is long-lived: out of the collector's walks
        self._recover_task = asyncio.get_running_loop().create_task(
            recovery.recover_forever(self, self._recovery), name="model-recovery"
        )
        if poll:
            self._poller = repository.RepositoryPoller(baseline)
            self._poll_task = asyncio.get_running_loop().create_task(
                polling.poll_forever(self, self._poller, self.server.repository_poll_secs),
                name="repository-poll",
            )

    def load_order(self, models: list[str]) -> list[str]:
        return repository.load_order(self.repository, models, self.server.allow_symlinked_models)

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
            entry.override = override
            try:
                await self._load(entry, model_dir, override, in_place, default_version)
            finally:
                entry.busy = ""
                for record in entry.records.values():
                    record.loading = False
                entry.prune()
                self._settle()
            return entry

    async def _load(
        self,
        entry: ModelEntry,
        model_dir: Path,
        override: dict[str, Any] | None,
        in_place: bool,
        default_version: int,
    ) -> None:
        try:  # (files read and parsed, labels of up to 16 MiB: off the event loop)
            config, wanted = await asyncio.to_thread(
                repository.what_to_load,
                self.repository,
                entry.name,
                override,
                self.server.allow_symlinked_models,
            )
        except ApplianceError as exc:
            self._failed(entry, str(exc))
            return
        files = await asyncio.to_thread(repository.version_files, model_dir, wanted)
        rebuilt_always = loader.loads_after_others(config)  # re-validated against its steps
        kept = {
            v
            for v in wanted
            if not rebuilt_always
            and v in entry.records
            and entry.records[v].keeps(config, files[v])
        }
        build = [v for v in wanted if v not in kept]
        for v in sorted(kept):
            log.info("model '%s' version %d: config and files unchanged, kept", entry.name, v)
        for v in build:
            entry.record(v).loading = True
        # the copies that stop serving if this load succeeds: rebuilt or no longer wanted
        replaced = {v: r.serving for v, r in entry.records.items() if r.serving and v not in kept}
        taken_down: dict[int, VersionRecord] = {}
        if in_place and build and replaced:  # no room for both: the old copies go first
            taken_down = await self._take_down(entry, replaced)
        elif build and entry.versions:  # the new copies build while the old ones serve
            refusal = self.budget.swap_shortfall(config.name, build, config.instance_count)
            if refusal:
                self._failed(entry, refusal + SWAP_HINT)
                return
        required = self._required(entry, build, config)
        built, failed = await self._build(config, model_dir, build, required)
        leaving: list[tuple[VersionRecord, Servable]] = []  # drained once unrouted
        for v, copy in built.items():
            record = entry.record(v)
            record.source, record.files = config, files[v]
            if record.serving is not None:
                leaving.append((record, record.serving))
            record.serving = copy
        succeeded = not build or bool(built)
        if not succeeded and taken_down:
            log.error(
                "model '%s': the in-place swap failed; loading the old copy again", entry.name
            )
            for v, r in taken_down.items():
                assert r.source is not None  # set by the build that made the copy
                restored, _ = await self._build(r.source, model_dir, [v], {})
                if restored:  # files None: read again now, a later load builds it afresh
                    r.serving, r.files = restored[v], None
        if succeeded:  # a load that built nothing it was asked to keeps what served
            for v, r in entry.records.items():
                if v not in wanted and r.serving is not None:
                    leaving.append((r, r.serving))
                    r.serving = None
            entry.default = default_version
        for v, r in entry.records.items():
            r.reason = failed.get(v, "") if r.serving is None else ""
        entry.flip()  # the next request goes to the new copies
        entry.reason = "; ".join(f"version {v}: {r}" for v, r in sorted(failed.items()))
        for record, copy in leaving:
            self._retire(entry, record, copy)

    def _required(self, entry: ModelEntry, build: list[int], config: ModelConfig) -> dict[int, int]:
        """A swap never leaves fewer instances than the copies serving now have."""
        serving = entry.versions
        if not serving:
            return {}
        newest = serving[max(serving)]
        return {
            v: min(config.instance_count, serving.get(v, newest).stats.instances) for v in build
        }

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
                    self.limiter,
                )
                if self.server.metrics_summary_latencies:
                    new[version].stats.latencies = LatencyWindow()
                if isinstance(copy := new[version], ModelVersion):
                    copy.use_cache(self.cache)
            except Exception as exc:  # one bad version must not stop the others
                swap = isinstance(exc, BudgetRefused) and bool(required)
                message = str(exc) + (SWAP_HINT if swap else "")
                failed[version] = message
                log.error("model '%s' version %d failed to load: %s", config.name, version, message)
        return new, failed

    async def _take_down(
        self, entry: ModelEntry, replaced: dict[int, Servable]
    ) -> dict[int, VersionRecord]:
        """In-place swap, first half: stop routing to the copies to be replaced, let
        them finish what they queued, unload them."""
        records = {v: entry.records[v] for v in replaced}
        for r in records.values():
            r.serving = None
        entry.flip()
        entry.reason = "in-place swap: the old copy is unloading"
        timeout = self.server.drain_timeout_s
        await asyncio.gather(
            *(self._drain(entry, records[v], c, timeout) for v, c in replaced.items())
        )
        return records

    def _failed(self, entry: ModelEntry, reason: str) -> None:
        entry.reason = reason
        log.error("model '%s' failed to load: %s", entry.name, reason)

    # ---- the one drain path ---------------------------------------------------------------

    async def _drain(
        self, entry: ModelEntry, record: VersionRecord, copy: Servable, timeout_s: float
    ) -> None:
        """``copy`` no longer serves (the caller took it out of the routing): let it
        finish its queued and running requests within ``timeout_s``, unload it."""
        record.draining.append(copy)
        try:
            await copy.unload(timeout_s)
        finally:
            record.draining.remove(copy)
            entry.prune()
            self._settle()  # the copy's objects become collectable again

    def _settle(self) -> None:
        """The set of loaded objects changed: :func:`appliance.heap.settle` (not while
        the start-up loads run, which settle once at their end, nor at shutdown)."""
        if self._started and not self._stopping:
            heap.settle()

    def _retire(self, entry: ModelEntry, record: VersionRecord, copy: Servable) -> None:
        """Drain ``copy`` in the background."""
        coro = self._drain(entry, record, copy, self.server.drain_timeout_s)
        task = asyncio.get_running_loop().create_task(coro)
        self._retired.add(task)  # keep a hard reference until it finishes
        task.add_done_callback(self._retired.discard)

    def _unroute(self, entry: ModelEntry) -> list[tuple[VersionRecord, Servable]]:
        """Stop routing to every version of ``entry``; the copies that served them."""
        copies = [(r, r.serving) for r in entry.records.values() if r.serving is not None]
        for r in entry.records.values():
            r.serving, r.reason = None, ""
        entry.flip()
        return copies

    async def _drain_all(
        self, entry: ModelEntry, copies: list[tuple[VersionRecord, Servable]], timeout_s: float
    ) -> None:
        await asyncio.gather(*(self._drain(entry, r, c, timeout_s) for r, c in copies))

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
            entry.reason, entry.unloaded = "unloaded", True
            try:
                await self._drain_all(entry, self._unroute(entry), self.server.drain_timeout_s)
            finally:
                entry.busy = ""

    # ---- what recovery and polling use (core/recovery, core/polling) -------------------

    @property
    def stopping(self) -> bool:
        return self._stopping

    def entries(self) -> list[ModelEntry]:
        return list(self._models.values())

    def entry_of(self, name: str) -> ModelEntry | None:
        return self._models.get(name)

    def forget(self, name: str) -> None:
        """Drop what is known of a model that left the repository (unloaded)."""
        self._models.pop(name, None)

    async def poll(self) -> None:
        """Apply what changed in the repository since the last poll (``poll`` mode)."""
        if self._poller is not None:
            await polling.poll(self, self._poller)

    # ---- routing and reporting ------------------------------------------------------------

    def get(self, name: str, version: str = "") -> Servable:
        """The version that serves a request, or Triton's error for it: INVALID_ARG for
        an unknown model or a version string that is not a number, NOT_FOUND for a
        version the model lacks, UNAVAILABLE for one not ready."""
        entry = self.entry(name)
        if not version:
            mv = entry.routed
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
            raise entry.not_serving(number)
        return mv

    def entry(self, name: str) -> ModelEntry:
        entry = self._models.get(name)
        if entry is None:
            raise invalid(f"Request for unknown model: '{name}' is not found")
        return entry

    def loaded(self) -> list[Servable]:
        return [mv for e in self._models.values() for mv in e.versions.values()]

    def draining(self) -> bool:
        """Whether an old copy of any model is still unloading."""
        return any(e.draining() for e in self._models.values())

    def all_ready(self) -> bool:
        return self._started and all(
            e.state == State.READY for e in self._models.values() if not e.unloaded
        )

    def index(self) -> list[dict[str, Any]]:
        """Triton's repository index: one row per model version (or per model with none).

        A version serving shows its copy's state (READY while a new copy is built or
        an old one drains), one being built LOADING, one whose old copy drains
        UNLOADING, a failed one UNAVAILABLE with its reason.
        """
        rows: list[dict[str, Any]] = []
        for name in self.names():
            entry = self._models.get(name)
            rows += entry.rows() if entry is not None else [{"name": name}]
        return rows

    async def stop(self, timeout_s: float) -> None:
        """Stop polling, then drain and unload everything (used at shutdown)."""
        self._stopping = True  # no heap settles on the way out
        if self._recover_task is not None:
            self._recover_task.cancel()
            await asyncio.gather(self._recover_task, return_exceptions=True)
            self._recover_task = None
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
            self._poll_task = None
        unrouted = [(e, self._unroute(e)) for e in self._models.values()]
        await asyncio.gather(
            *(self._drain_all(e, copies, timeout_s) for e, copies in unrouted),
            return_exceptions=True,
        )
        if self._retired:
            await asyncio.gather(*self._retired, return_exceptions=True)
        heap.release()  # what start-up froze is garbage now, or will be

