"""``poll`` mode: the repository's changes applied as they appear on disk.

Every ``repository_poll_secs`` the repository is read again (a snapshot of each
model folder's files, :class:`appliance.core.repository.RepositoryPoller`, on a
worker thread): a model folder that left is unloaded, one that is new or changed is
loaded (ensembles after the models their steps name). A model being loaded or
unloaded is looked at again at the next poll.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Protocol

from appliance.core import repository
from appliance.core.versions import ModelEntry
from appliance.errors import ApplianceError

log = logging.getLogger("appliance.core.lifecycle")


class Models(Protocol):
    """What polling needs of the lifecycle."""

    repository: Path

    def entry_of(self, name: str) -> ModelEntry | None: ...

    def forget(self, name: str) -> None: ...

    def load_order(self, models: list[str]) -> list[str]: ...

    async def load(self, name: str) -> ModelEntry: ...

    async def unload(self, name: str) -> None: ...


async def poll_forever(models: Models, poller: repository.RepositoryPoller, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            await poll(models, poller)
        except Exception:  # a bad poll must not end polling
            log.exception("polling the model repository failed")


async def poll(models: Models, poller: repository.RepositoryPoller) -> None:
    """Apply what changed in the repository since the last poll."""
    current = await asyncio.to_thread(repository.snapshot, models.repository)
    to_load, to_unload = poller.changes(current)
    for name in to_unload:
        entry = models.entry_of(name)
        if entry is not None and entry.busy:
            continue  # next poll
        log.info("model '%s' left the repository: unloading it", name)
        if entry is not None:
            await models.unload(name)
            models.forget(name)
        poller.forget(name)
    for name in models.load_order(sorted(to_load)):  # ensembles after their steps
        log.info("model '%s' changed in the repository: loading it", name)
        poller.applied(name, current[name])
        try:
            await models.load(name)
        except ApplianceError as exc:  # e.g. the folder vanished meanwhile
            log.error("model '%s': %s", name, exc)
