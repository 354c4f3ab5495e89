"""Over-the-air model updates: signed bundles, a TUF repository, the device agent.

Fleet side: :mod:`ota.keys` (role keys), :mod:`ota.repo` (the TUF repository:
init, publish, rollout, key rotation), :mod:`ota.bundle` (build and inspect model
bundles), :mod:`ota.watch` (follow device reports, halt a failing rollout).
Device side: :mod:`ota.agent` (the update state machine) with :mod:`ota.state`
(its persisted state), :mod:`ota.download` (resumable verified downloads),
:mod:`ota.server_api` (the appliance's HTTP API) and :mod:`ota.report` (MQTT
reports). :mod:`ota.rollout` decides which devices a rollout includes; both sides
use it. The package runs as its own process and never imports the server.
"""

from __future__ import annotations

ROLES = ("root", "targets", "snapshot", "timestamp")


class OtaError(Exception):
    """A refused update or a failed fleet operation; the message says why, for a person."""
