"""The gateway's end of ``Decode.Session``: one call per decode pod carries every request.

A decode pod answers one message per engine step with the tokens of every request it
streams to this gateway, where per-request calls cost a message per token and request on
both sides. ``SessionCall`` stands in for the per-request call it replaces: it iterates
the request's ``GenerateResponse``s, ``cancel()`` makes the iteration raise
``asyncio.CancelledError`` (and cancels the request on the pod), and a failure raises a
``grpc.RpcError`` with the status the request's own call would have had: what the pod
answered for the request, or the session's own failure (UNAVAILABLE when the pod died) for
every request it carried. So the relay's failure handling (migration, chain fallback) reads
the same as over per-request calls.

Everything here runs on the gateway's event loop. A session whose call ended is replaced
by a fresh one for the next request; one retired (its channel's certificates rotated)
ends once its last request has.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc

from baton.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_CANCELLED = object()  # a SessionCall's queue: the caller cancelled it


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class DecodeSession:
    """One ``Decode.Session`` call to one pod and the requests open on it."""

    def __init__(self, stub: decode_pb2_grpc.DecodeStub) -> None:
        self._commands: asyncio.Queue = asyncio.Queue()
        self._calls: dict[int, SessionCall] = {}
        self._numbers = itertools.count(1)
        self._error: grpc.RpcError | None = None  # set once the call is over
        self._retired = False
        self._call = stub.Session(self._command_stream())
        self._reader = asyncio.ensure_future(self._read())

    @property
    def ended(self) -> bool:
        return self._error is not None

    def generate(self, request: decode_pb2.DecodeGenerateRequest) -> SessionCall:
        return SessionCall(self, decode_pb2.SessionCommand(stream=next(self._numbers), generate=request))

    def attach(self, request: decode_pb2.AttachRequest) -> SessionCall:
        return SessionCall(self, decode_pb2.SessionCommand(stream=next(self._numbers), attach=request))

    def retire(self) -> None:
        """End once the requests open now have (no new ones come: the caller replaced it)."""
        self._retired = True
        if not self._calls:
            self.close()

    def close(self) -> None:
        """End the call; requests still open fail with CANCELLED."""
        self._commands.put_nowait(None)
        self._call.cancel()

    # --- its requests (for SessionCall) ------------------------------------------------------

    def register(self, call: SessionCall) -> None:
        if self._error is not None:
            call.deliver(self._error)
            return
        self._calls[call.number] = call
        self._commands.put_nowait(call.command)

    def unregister(self, call: SessionCall, cancel: bool) -> None:
        self._calls.pop(call.number, None)
        if cancel and self._error is None:
            self._commands.put_nowait(decode_pb2.SessionCommand(stream=call.number, cancel=True))
        if self._retired and not self._calls:
            self.close()

    # --- the call --------------------------------------------------------------------------

    async def _command_stream(self) -> AsyncIterator[decode_pb2.SessionCommand]:
        while (command := await self._commands.get()) is not None:
            yield command

    async def _read(self) -> None:
        try:
            async for message in self._call:
                for step in message.steps:
                    call = self._calls.get(step.stream)
                    if call is not None:
                        call.deliver(step)
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the decode pod ended the session")
        except grpc.RpcError as e:  # the pod died or refused the session: every request fails so
            error = e
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the session")
        self._error = error
        calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call.deliver(error)


class SessionCall:
    """One request on a session, used like the per-request call: iterate it once."""

    def __init__(self, session: DecodeSession, command: decode_pb2.SessionCommand) -> None:
        self.session = session
        self.command = command
        self.number = command.stream
        # Unbounded, but a request's steps are at most its max_tokens: a client that reads
        # slowly holds its own steps here, and one that stops is cut off by its door.
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = False

    def cancel(self) -> bool:
        if not self._cancelled:
            self._cancelled = True
            self._queue.put_nowait(_CANCELLED)
        return True

    def deliver(self, item: decode_pb2.SessionStep | grpc.RpcError) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[common_pb2.GenerateResponse]:
        return self._steps()

    async def _steps(self) -> AsyncIterator[common_pb2.GenerateResponse]:
        if self._cancelled:
            raise asyncio.CancelledError()
        self.session.register(self)
        over = False  # the pod holds nothing more for it
        try:
            while True:
                item = await self._queue.get()
                if item is _CANCELLED or self._cancelled:  # steps that came before: dropped
                    raise asyncio.CancelledError()
                if isinstance(item, grpc.RpcError):
                    over = True
                    raise item
                if not item.HasField("step"):
                    over = True
                    raise rpc_error(_CODES.get(item.code, grpc.StatusCode.UNKNOWN), item.message)
                over = item.step.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                yield item.step
                if over:
                    return
        finally:
            self.session.unregister(self, cancel=not over)
