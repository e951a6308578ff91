"""What a decode pod answers for a request that failed: the one rule its own calls (Generate,
Attach, PushKV) and a session's streams share."""

from __future__ import annotations

import logging

import grpc

from baton.api import convert
from baton.decode.streams import StreamFailed

log = logging.getLogger(__name__)


def failure_answer(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message for ``error`` (``convert.status_for``); an unexpected error, one
    that is neither the caller's nor a stream the engine failed, is logged with its trace."""
    code = convert.status_for(error)
    if code is grpc.StatusCode.INTERNAL and not isinstance(error, StreamFailed):
        log.error("internal error in a decode call", exc_info=error)
    return code, str(error) or type(error).__name__
