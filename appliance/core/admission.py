"""One request's admission: the ticket an adapter takes before it reads a payload.

:meth:`DataPlane.admit <appliance.core.dataplane.DataPlane.admit>` looks the model
version up once and returns a :class:`Ticket` that travels with the request to its
answer, on every transport:

- the **servable** the request goes to, and its :class:`~appliance.core.limits.RequestRules`;
- the **hold** on the queued bytes (:mod:`appliance.core.queue_bytes`), sized by what
  the request declares before its payload is read, set to the decoded tensors' bytes
  when it is queued, released once it is answered (:meth:`release`);
- the **declarations**: the codec calls :meth:`declare` with each input's name,
  datatype and shape before it decodes that input's data, so the model's rules and
  the server's element limit (:mod:`appliance.core.limits`) are applied once, and the
  model checks only what needs the whole request (:meth:`trusts`).

A refusal at :meth:`declare` is counted as a failed request of the model, as if the
model had refused the decoded request itself (on the event loop: a big body is
decoded on a worker thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from appliance.core.limits import RequestRules, count_elements
from appliance.core.queue_bytes import Hold
from appliance.core.servable import Servable
from appliance.errors import ApplianceError


class Ticket:
    """What one admitted request carries from its adapter to its answer."""

    __slots__ = (
        "_after",
        "_loop",
        "declared",
        "elements",
        "hold",
        "max_elements",
        "object_elements",
        "rules",
        "servable",
    )

    def __init__(
        self, servable: Servable, rules: RequestRules, hold: Hold, max_elements: int
    ) -> None:
        self.servable = servable
        self.rules = rules
        self.hold = hold
        self.max_elements = max_elements
        self.elements = 0
        # BYTES elements declared: each becomes a Python object when decoded, so an
        # adapter decodes many of them off the event loop
        self.object_elements = 0
        self.declared = False  # every input of the request went through declare()
        self._loop = asyncio.get_running_loop()
        self._after: list[Callable[[], None]] = []

    def declare(
        self, name: str, datatype: str, shape: Sequence[int], count: int | None = None
    ) -> None:
        """Check one input's declaration (the server's element limit, then the model's
        rules) before its data is decoded; INVALID_ARG, counted, when it fails.
        ``count``: the shape's element count when the caller has it."""
        try:
            if count is None or self.elements + count > self.max_elements:
                count = count_elements(shape, self.elements, self.max_elements, name)
            self.rules.declare(name, datatype, shape)
        except ApplianceError as exc:
            self._refused(exc)
            raise
        self.elements += count
        if datatype == "BYTES":
            self.object_elements += count

    def planned(self, elements: int) -> None:
        """Every input of the request was declared at once, ``elements`` in all, by a
        plan that checked them as :meth:`declare` would
        (:mod:`appliance.adapters.codec.kserve_plan`: within the element limit, each
        input as the version's rules declare it)."""
        self.elements = elements
        self.declared = True

    def trusts(self, servable: Servable) -> bool:
        """Whether ``servable`` may skip the per-input checks: every input was declared
        to this ticket, and the request goes to the version that admitted it (a hot
        swap in between brings other rules, checked in full)."""
        return self.declared and servable is self.servable

    def on_release(self, done: Callable[[], None]) -> None:
        """Call ``done`` when the request is answered (a shared-memory region it holds)."""
        self._after.append(done)

    def release(self) -> None:
        self.hold.release()
        after, self._after = self._after, []
        for done in after:
            done()

    def _refused(self, exc: ApplianceError) -> None:
        stats = self.servable.stats
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # a worker thread
            here = False
        if here:
            stats.record_error(exc, 0)
        else:
            self._loop.call_soon_threadsafe(stats.record_error, exc, 0)
