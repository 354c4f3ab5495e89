"""Model lifecycle: which models and versions exist, their states, load and unload.

A model loads as a set of versions chosen by its version policy. Loading builds
the new versions completely (instances created, config completed) before the
routing table points at them; the versions they replace are then drained and
unloaded, so a reload never fails a request that was already admitted. A model
whose config or files are bad becomes UNAVAILABLE with the reason; the others
keep serving.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.config import load_model_config
from appliance.errors import not_found, unavailable
from appliance.model import ModelVersion, State
from appliance.server_config import ServerConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelEntry:
    """Everything known about one model name."""

    name: str
    versions: dict[int, ModelVersion] = field(default_factory=dict)  # ready, newest served first
    failed: dict[int, str] = field(default_factory=dict)  # version -> reason
    state: State = State.UNAVAILABLE
    reason: str = ""

    def newest(self) -> ModelVersion | None:
        return self.versions[max(self.versions)] if self.versions else None


def _version_dirs(model_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


class ModelLifeCycle:
    """Owns every ModelVersion; all methods run on the event loop."""

    def __init__(self, repository: Path, server: ServerConfig) -> None:
        self.repository = repository
        self.server = server
        self._models: dict[str, ModelEntry] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._retired: set[asyncio.Task[None]] = set()

    def names(self) -> list[str]:
        return sorted(
            p.name for p in self.repository.iterdir() if p.is_dir() and not p.name.startswith(".")
        )

    async def load_all(self) -> None:
        """Load every model in the repository, one after another (a small device has
        few cores; loading in parallel would only slow the models already serving)."""
        for name in self.names():
            await self.load(name)

    async def load(self, name: str) -> ModelEntry:
        """(Re)load ``name`` from the repository. Never raises for a bad model: the
        failure is logged and recorded as the model's UNAVAILABLE reason."""
        model_dir = self.repository / name
        if not model_dir.is_dir():
            raise not_found(f"model '{name}' is not in the model repository")
        async with self._locks.setdefault(name, asyncio.Lock()):
            entry = self._models.setdefault(name, ModelEntry(name))
            if not entry.versions:
                entry.state = State.LOADING
            new: dict[int, ModelVersion] = {}
            failed: dict[int, str] = {}
            try:
                config = load_model_config(model_dir)
                wanted = config.version_policy.select(_version_dirs(model_dir))
                if not wanted:
                    raise not_found(
                        f"model '{name}' has no version folder that its version "
                        f"policy serves in {model_dir}"
                    )
                for version in wanted:
                    try:
                        new[version] = await ModelVersion.load(
                            config, model_dir / str(version), self.server
                        )
                    except Exception as exc:  # one bad version must not stop the others
                        failed[version] = str(exc)
                        log.error("model '%s' version %d failed to load: %s", name, version, exc)
            except Exception as exc:
                entry.reason = str(exc)
                log.error("model '%s' failed to load: %s", name, exc)
                if not entry.versions:
                    entry.state = State.UNAVAILABLE
                return entry
            old = entry.versions
            entry.versions, entry.failed = new, failed  # the routing flip
            entry.state = State.READY if new else State.UNAVAILABLE
            entry.reason = "; ".join(f"version {v}: {r}" for v, r in failed.items())
            for mv in old.values():
                self._retire(mv)
            return entry

    def _retire(self, mv: ModelVersion) -> None:
        task = asyncio.get_running_loop().create_task(mv.unload(self.server.drain_timeout_s))
        self._retired.add(task)  # keep a hard reference until it finishes
        task.add_done_callback(self._retired.discard)

    async def unload(self, name: str) -> None:
        """Stop routing to ``name``, drain its versions and free them."""
        entry = self._models.get(name)
        if entry is None:
            raise not_found(f"model '{name}' is not loaded")
        async with self._locks.setdefault(name, asyncio.Lock()):
            old, entry.versions = entry.versions, {}
            entry.state, entry.reason = State.UNAVAILABLE, "unloaded"
            await asyncio.gather(*(mv.unload(self.server.drain_timeout_s) for mv in old.values()))

    def get(self, name: str, version: str = "") -> ModelVersion:
        """The version that serves a request; NOT_FOUND or UNAVAILABLE otherwise."""
        entry = self._models.get(name)
        if entry is None:
            raise not_found(f"unknown model '{name}'")
        if not version:
            mv = entry.newest()
            if mv is None:
                raise unavailable(
                    f"model '{name}' is not ready ({entry.state.value}"
                    f"{': ' + entry.reason if entry.reason else ''})"
                )
            return mv
        if not version.isdigit():
            raise not_found(f"model '{name}' has no version '{version}'")
        mv = entry.versions.get(int(version))
        if mv is None:
            if int(version) in entry.failed:
                raise unavailable(
                    f"model '{name}' version {version} is not ready: {entry.failed[int(version)]}"
                )
            raise not_found(f"model '{name}' has no version '{version}'")
        return mv

    def entry(self, name: str) -> ModelEntry:
        entry = self._models.get(name)
        if entry is None:
            raise not_found(f"unknown model '{name}'")
        return entry

    def loaded(self) -> list[ModelVersion]:
        return [mv for e in self._models.values() for mv in e.versions.values()]

    def all_ready(self) -> bool:
        return all(e.state == State.READY for e in self._models.values())

    def index(self) -> list[dict[str, Any]]:
        """Triton's repository index: one row per model version (or per model with none)."""
        rows: list[dict[str, Any]] = []
        for name in self.names():
            entry = self._models.get(name)
            if entry is None:
                rows.append({"name": name})
                continue
            for v, mv in sorted(entry.versions.items()):
                rows.append(
                    {"name": name, "version": str(v), "state": mv.state.value, "reason": ""}
                )
            for v, reason in sorted(entry.failed.items()):
                rows.append(
                    {"name": name, "version": str(v), "state": "UNAVAILABLE", "reason": reason}
                )
            if not entry.versions and not entry.failed:
                rows.append({"name": name, "state": entry.state.value, "reason": entry.reason})
        return rows

    async def stop(self, timeout_s: float) -> None:
        """Drain and unload everything (used at shutdown)."""
        versions = self.loaded()
        for entry in self._models.values():
            entry.versions, entry.state = {}, State.UNAVAILABLE
        await asyncio.gather(*(mv.unload(timeout_s) for mv in versions), return_exceptions=True)
        if self._retired:
            await asyncio.gather(*self._retired, return_exceptions=True)
