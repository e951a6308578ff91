"""HTTP statuses and OpenAI's error bodies for the errors a request may meet."""

from __future__ import annotations

from aiohttp import web

from baton.api import convert
from baton.errors import TooLarge
from baton.gateway.http.answers import error_body
from baton.gateway.served_model import UnknownModel

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401,
               "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "ALREADY_EXISTS": 409,
               "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "FAILED_PRECONDITION": 503,
               "DEADLINE_EXCEEDED": 504, "DATA_LOSS": 502, "ABORTED": 409, "CANCELLED": 499}
RETRY_AFTER_S = 1  # told to a client refused for being one too many (429) or too early (503)


def http_status(error: BaseException) -> int:
    """The HTTP status of an error (its gRPC status mapped; a request too large is 413)."""
    if isinstance(error, TooLarge):
        return 413
    return HTTP_STATUS.get(convert.status_for(error).name, 500)


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return web.json_response(error_body(status, message, param, code), status=status,
                             headers=headers)


def error_fields(error: BaseException) -> tuple[str | None, str | None]:
    """OpenAI's ``param`` and ``code`` of an error, where baton knows them."""
    return getattr(error, "param", None), "model_not_found" if isinstance(error, UnknownModel) else None
