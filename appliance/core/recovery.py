"""A model that lost its engine is loaded again, with back-off.

A loaded version can stop serving without anyone unloading it: a language model's
engine process ends (an OOM kill), an isolated Python model's worker crashes often
enough in a row that its instance gives up (``process_max_failures``). Its state
turns UNAVAILABLE and it refuses requests. On a device that runs unattended for
months nobody is there to load it again, so the lifecycle does: it checks every
:data:`CHECK_S` seconds, and a model with such a version is loaded again at once,
then, if it breaks again, after 1, 2, 4, ... seconds, at most every
:data:`LONGEST_S` (a model that crashes at every start costs one load every five
minutes, not a loop). A model that stayed whole for :data:`STEADY_S` after its last
recovery starts from the first step again. A model unloaded on request, or one whose
load failed (no serving copy: its reason says why), is left alone: that is the
operator's or the repository's to change, and poll mode reloads it when its files do.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from appliance.core.servable import State
from appliance.core.versions import ModelEntry

log = logging.getLogger("appliance.core.lifecycle")

CHECK_S = 1.0
FIRST_S = 1.0
LONGEST_S = 300.0
STEADY_S = 60.0


def lost_versions(entry: ModelEntry) -> list[int]:
    """The versions whose serving copy no longer serves (UNAVAILABLE while routed)."""
    return [v for v, copy in sorted(entry.versions.items()) if copy.state is State.UNAVAILABLE]


@dataclass(slots=True)
class _Tries:
    count: int = 0
    next_at: float = 0.0  # no load again before this time
    last_at: float = 0.0  # when it was last loaded again


class Recovery:
    """Which broken models are due to be loaded again (pure bookkeeping; times are
    the event loop's clock)."""

    def __init__(self) -> None:
        self._tries: dict[str, _Tries] = {}

    def due(self, name: str, broken: bool, now: float) -> bool:
        tries = self._tries.get(name)
        if not broken:
            if tries is not None and now - tries.last_at >= STEADY_S:
                del self._tries[name]  # whole again for long enough: start over
            return False
        if tries is None:
            tries = self._tries[name] = _Tries()
        if now < tries.next_at:
            return False
        tries.count += 1
        tries.last_at = now
        tries.next_at = now + min(LONGEST_S, FIRST_S * 2 ** (tries.count - 1))
        return True

    def tries(self, name: str) -> int:
        """How many times in a row ``name`` was loaded again."""
        tries = self._tries.get(name)
        return tries.count if tries is not None else 0


class Models(Protocol):
    """What the recovery loop needs of the lifecycle."""

    @property
    def stopping(self) -> bool: ...

    def entries(self) -> list[ModelEntry]: ...

    async def load(
        self,
        name: str,
        override: dict[str, Any] | None = None,
        in_place: bool = False,
        default_version: int = 0,
    ) -> ModelEntry: ...


async def recover_forever(models: Models, recovery: Recovery) -> None:
    """Every :data:`CHECK_S`: load again, in place (the broken copy serves nothing),
    each model that has a lost version and is due, with its last load's override and
    default version; a model being loaded or unloaded, or unloaded on request, is
    left alone."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(CHECK_S)
        for entry in models.entries():
            if models.stopping or entry.busy or entry.unloaded:
                continue
            lost = lost_versions(entry)
            if not recovery.due(entry.name, bool(lost), loop.time()):
                continue
            log.warning(
                "model '%s' version(s) %s stopped serving (an engine process ended, "
                "or an instance gave up): loading it again (recovery %d in a row)",
                entry.name, lost, recovery.tries(entry.name),
            )  # fmt: skip
            try:
                await models.load(entry.name, entry.override, True, entry.default)
            except Exception:  # one model's failed recovery must not end the others'
                log.exception("recovering model '%s' failed", entry.name)
