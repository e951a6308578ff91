"""Why a decode pod refuses a request or a push (each maps to its gRPC status)."""

from __future__ import annotations

from baton.errors import Aborted, AlreadyExists, DataLoss, NotFound


class RequestExists(AlreadyExists):
    """A live request already has this id (gRPC ALREADY_EXISTS)."""


class RequestLeaving(RequestExists):
    """The id's stream was aborted and has not left the engine yet (ALREADY_EXISTS if it
    does not leave in time)."""


class RequestNotFound(NotFound):
    """No state for this request id (gRPC NOT_FOUND)."""


class RequestAborted(Aborted):
    """The request was aborted before its cache arrived (gRPC ABORTED)."""


class PushFailed(DataLoss):
    """The chain's push for this request was refused or lost before its stream opened
    (gRPC DATA_LOSS: the KV will not come; the caller prefills the prompt, here or
    elsewhere)."""
