"""Who may do what: bearer tokens for admin and inference calls, by one pure policy.

Admin calls (repository load/unload, shared-memory registration) change what runs
on the device. On a loopback bind only local processes can reach them, so they
are open unless a token is configured. On any other bind they need the
``admin_token`` from the server config; with none configured they are refused
(403) with a message saying how to enable them, never silently open. Inference
and metadata calls are open unless an ``inference_token`` is configured (the
admin token is accepted there too). Health and server metadata are always open,
for probes and load balancers.

Protocol-neutral: adapters classify each call into a :class:`Scope`, pass the
``Authorization`` header (HTTP) or metadata (gRPC), and map a :class:`Denial` to
their wire (HTTP 401/403, gRPC UNAUTHENTICATED/PERMISSION_DENIED).
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from appliance.config.server_config import ServerConfig


class Scope(enum.Enum):
    PUBLIC = "public"  # health, server metadata
    INFERENCE = "inference"  # infer, model metadata/config/stats, repository index
    ADMIN = "admin"  # load, unload, shared-memory register/unregister


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a call is refused. ``forbidden``: no token could help (403), else the
    caller must present a valid token (401)."""

    forbidden: bool
    message: str


def is_loopback(host: str) -> bool:
    """True when ``host`` (a bind address) is reachable from this machine only."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name or an interface we cannot judge: treat as exposed


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    admin_token: str = ""
    inference_token: str = ""
    admin_exposed: bool = False  # admin calls need a token (non-loopback, or asked for)
    host: str = "127.0.0.1"

    @classmethod
    def from_config(cls, config: ServerConfig) -> AccessPolicy:
        return cls(
            admin_token=config.admin_token,
            inference_token=config.inference_token,
            admin_exposed=config.require_admin_token or not is_loopback(config.host),
            host=config.host,
        )

    def check_all(self, scope: Scope, authorizations: Sequence[str]) -> Denial | None:
        """:meth:`check` for every ``Authorization`` value a call carried: more than
        one is refused (which one counts would be a guess a proxy and we could make
        differently)."""
        if len(authorizations) > 1 and scope is not Scope.PUBLIC:
            return Denial(
                False,
                f"the call carries {len(authorizations)} Authorization headers; send exactly "
                f"one: 'Authorization: Bearer <token>'",
            )
        return self.check(scope, authorizations[0] if authorizations else None)

    def check(self, scope: Scope, authorization: str | None) -> Denial | None:
        """None when the call may proceed, else why not."""
        if scope is Scope.PUBLIC:
            return None
        token = bearer(authorization)
        if scope is Scope.ADMIN:
            if self.admin_token:
                return None if _same(token, self.admin_token) else _needs("an admin")
            if self.admin_exposed:
                return Denial(
                    True,
                    f"admin calls (model load/unload, shared-memory registration) are "
                    f"disabled: the server listens on {self.host}, which is not loopback-only "
                    f"(or require_admin_token is set), and no admin_token is configured; "
                    f"set admin_token in the server config and send "
                    f"'Authorization: Bearer <token>'",
                )
            return None
        if not self.inference_token:
            return None
        if _same(token, self.inference_token) or (
            self.admin_token and _same(token, self.admin_token)
        ):
            return None
        return _needs("an inference")


def _same(given: str | None, expected: str) -> bool:
    # surrogatepass: header bytes that are not UTF-8 arrive as lone surrogates, and
    # such a token is simply wrong, never an error
    return given is not None and hmac.compare_digest(
        given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass")
    )


def _needs(kind: str) -> Denial:
    return Denial(False, f"this call needs {kind} token: send 'Authorization: Bearer <token>'")
