"""The errors a caller can be told about, each carrying the gRPC status it is answered with.

Every error that crosses an API edge derives from ``ServiceError`` and names its status in
``status`` (a ``grpc.StatusCode`` name, so the modules that raise them need not import
gRPC); ``baton.api.convert.status_for`` is the one place that turns an error into a status
(a ``ValueError`` is the caller's bad input: INVALID_ARGUMENT; anything else is INTERNAL).
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base of the errors a caller is told about; ``status`` is their gRPC status name."""

    status = "INTERNAL"


class NotFound(ServiceError):
    status = "NOT_FOUND"


class AlreadyExists(ServiceError):
    status = "ALREADY_EXISTS"


class Aborted(ServiceError):
    status = "ABORTED"


class Unavailable(ServiceError):
    status = "UNAVAILABLE"


class ResourceExhausted(ServiceError):
    status = "RESOURCE_EXHAUSTED"


class InvalidArgument(ServiceError, ValueError):
    status = "INVALID_ARGUMENT"


class TooLarge(InvalidArgument):
    """A request too large to be read at all (HTTP 413; INVALID_ARGUMENT over gRPC)."""


class Unauthenticated(ServiceError):
    status = "UNAUTHENTICATED"


class PermissionDenied(ServiceError):
    status = "PERMISSION_DENIED"


class Passed(ServiceError):
    """A downstream pod's error handed on to the caller with the pod's own status."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class FailedPrecondition(ServiceError):
    status = "FAILED_PRECONDITION"


class DataLoss(ServiceError):
    status = "DATA_LOSS"


class WrongIncarnation(FailedPrecondition):
    """Work routed to an earlier process on this address (a pod that restarted there)."""

    def __init__(self, what: str, address: str, mine: str, theirs: str) -> None:
        super().__init__(f"{what} was meant for incarnation {theirs!r} of {address}; this is "
                         f"incarnation {mine!r} (the pod restarted): route it again")


def check_incarnation(what: str, address: str, mine: str, theirs: str) -> None:
    """Raise WrongIncarnation when the caller names another incarnation ("" = any)."""
    if theirs and theirs != mine:
        raise WrongIncarnation(what, address, mine, theirs)
