"""Over-the-air model updates: signed bundles, a TUF repository, the device agent.

Fleet side: :mod:`appliance.ota.keys` (role keys), :mod:`appliance.ota.repo` (the TUF repository:
init, publish, rollout, key rotation), :mod:`appliance.ota.bundle` (build and inspect model
bundles), :mod:`appliance.ota.watch` (follow device reports, halt a failing rollout).
Device side: :mod:`appliance.ota.agent` (the update cycle) running the steps of
:mod:`.fetching` (download, verify, stage), :mod:`.trial` (load, self-test,
switch, probation) and :mod:`appliance.ota.commit` (commit, rollback, and the convergence of
state, disk and server after a crash) on a :class:`appliance.ota.context.Context`, with
:mod:`appliance.ota.state` (its persisted state), :mod:`appliance.ota.download` (resumable verified
downloads), :mod:`.server_api` (the appliance's HTTP API) and :mod:`.report`
(MQTT reports). :mod:`appliance.ota.rollout` decides which devices a rollout includes; both
sides use it. The package runs as its own process and never imports the server.
"""

from __future__ import annotations

ROLES = ("root", "targets", "snapshot", "timestamp")


class OtaError(Exception):
    """A refused update or a failed fleet operation; the message says why, for a person."""


class Transient(OtaError):
    """A passing condition (repository unreachable, disk full, mirror too slow): the
    job is kept as it is and tried again at the next check, after a back-off."""


class Withdrawn(OtaError):
    """The fleet no longer offers the job (halted, removed, or a newer version): it is
    undone without marking the version bad."""


class Rollback(OtaError):
    """The candidate failed after it touched the device: undo and mark it bad."""
