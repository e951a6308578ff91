"""One answer streamed as Server-Sent Events: ``data: {chunk}`` per event, ``data: [DONE]``
last; an error after the first event is an error chunk, then [DONE]. A client that has not
taken an event within ``stall_s`` is cut off: the ConnectionError ends the handler, which
aborts the request on every pod.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from baton.gateway.http.answers import error_body
from baton.gateway.http.errors import error_fields, http_status

log = logging.getLogger(__name__)


def _sse(body: dict | str) -> bytes:
    text = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class EventStream:
    def __init__(self, request: web.Request, response_id: str, stall_s: float) -> None:
        self.request = request
        self.response_id = response_id
        self.stall_s = stall_s
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache",
                                                    "X-Request-Id": response_id})

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, body: dict | str) -> None:
        """Write one event (ConnectionError: the client left, or stopped reading)."""
        try:
            # A timeout scope, not wait_for: that would wrap every event's write in a task of
            # its own and a pass of the event loop (4,096 of them for 64 streams of 64 tokens).
            async with asyncio.timeout(self.stall_s):
                await self.response.write(_sse(body))
        except TimeoutError:
            log.warning("a client of %s read nothing for %g s: cut off", self.request.path,
                        self.stall_s)
            if self.request.transport is not None:
                self.request.transport.abort()
            raise ConnectionResetError("the client stopped reading") from None

    async def fail(self, error: Exception) -> None:
        """A failure after the stream began: an error chunk."""
        status = http_status(error)
        if status == 500:
            log.error("stream %s failed", self.response_id, exc_info=error)
        try:
            await self.send(error_body(status, str(error), *error_fields(error)))
        except ConnectionError:
            pass

    async def close(self) -> web.StreamResponse:
        try:
            await self.send("[DONE]")
            await self.response.write_eof()
        except ConnectionError:
            pass
        return self.response
