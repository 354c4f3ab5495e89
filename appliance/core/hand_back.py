"""Rounds in which every instance of a batcher hands back its engine's working memory.

After a burst the data plane asks each model's batcher for a round
(``DynamicBatcher.release_memory``): each instance, on its own thread and between
batches, asks its engine to give back what it keeps (``memory.hand_back``: ONNX
Runtime's arena, the thread's heap top). The round's future is done once every
instance has, or the batcher stopped. The state is read and changed under the
batcher's lock; the future lives on the event loop.
"""

from __future__ import annotations

import asyncio


class HandBack:
    def __init__(self) -> None:
        self.asked: set[int] = set()  # instances asked, not yet started
        self.busy = 0  # instances handing back now
        self.future: asyncio.Future[None] | None = None  # done when all have

    @property
    def active(self) -> bool:
        """A round is under way (no inline run meanwhile: it would use an engine that
        is handing memory back)."""
        return bool(self.asked) or self.busy > 0

    def ask(
        self, loop: asyncio.AbstractEventLoop, instances: int, open_: bool
    ) -> asyncio.Future[None]:
        """Start a round of ``instances`` (done at once when the batcher is not
        ``open_``); the caller then wakes the instances."""
        if self.future is None or self.future.done():
            self.future = loop.create_future()
        if not open_:
            self.future.set_result(None)
        else:
            self.asked = set(range(instances))
        return self.future

    def take(self, index: int, queue_empty: bool) -> bool:
        """Whether instance ``index`` hands back now (only with nothing queued)."""
        if index in self.asked and queue_empty:
            self.asked.discard(index)
            self.busy += 1
            return True
        return False

    def finished(self) -> bool:
        """One instance has handed back; True when the round is over."""
        self.busy -= 1
        return not self.asked and not self.busy

    def cancel(self) -> None:
        self.asked.clear()

    def done(self) -> None:
        """(On the loop.) The round is over."""
        if self.future is not None and not self.future.done():
            self.future.set_result(None)
