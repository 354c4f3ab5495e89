"""Protocol-neutral errors.

Everything below the protocol adapters raises :class:`ApplianceError` with a
:class:`Code`; each adapter maps the code to its wire (HTTP status, gRPC status,
MQTT error reply) in one place. Messages are written for the person who sent the
request: they name the model, tensor or field and say what was expected.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    INVALID_ARG = "INVALID_ARG"  # the request or config is wrong; retrying won't help
    NOT_FOUND = "NOT_FOUND"  # unknown model, version or route
    UNAVAILABLE = "UNAVAILABLE"  # overloaded, timed out, loading or stopping; may retry
    TOO_LARGE = "TOO_LARGE"  # payload larger than the configured limit
    INTERNAL = "INTERNAL"  # a bug or a backend failure


class FailureReason(enum.Enum):
    """Triton's ``reason`` label of ``nv_inference_request_failure``."""

    REJECTED = "REJECTED"  # queue full or queue timeout
    CANCELED = "CANCELED"  # the caller went away
    BACKEND = "BACKEND"  # the inference engine raised
    OTHER = "OTHER"  # invalid request and everything else


class ApplianceError(Exception):
    """An error with a protocol-neutral code and a message fit for the caller."""

    def __init__(
        self, code: Code, message: str, reason: FailureReason = FailureReason.OTHER
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason

    def __str__(self) -> str:
        return self.message


def invalid(message: str) -> ApplianceError:
    return ApplianceError(Code.INVALID_ARG, message)


def not_found(message: str) -> ApplianceError:
    return ApplianceError(Code.NOT_FOUND, message)


def unavailable(message: str, reason: FailureReason = FailureReason.OTHER) -> ApplianceError:
    return ApplianceError(Code.UNAVAILABLE, message, reason)


def internal(message: str, reason: FailureReason = FailureReason.OTHER) -> ApplianceError:
    return ApplianceError(Code.INTERNAL, message, reason)
