"""A gateway's ``Decode.Session`` call: many requests' streams over one call.

The gateway opens requests on the session (Generate or Attach, each under a number of
its own) and cancels them; every open request runs as a task that reads its
``RequestStream`` exactly as its own Generate or Attach call would (same stream interval,
same abort when it is cancelled) and drops each message into the session's outbox. The
call sends the outbox whenever it has something: the tasks an engine step wakes all run
before the call's writer does, so one step's tokens for every request leave as one
message (a message per token costs CPU on each side of the wire, which on a busy node is
CPU the engine loses).

A request that fails answers one ``SessionStep`` with the status its own call would
have ended with; the others go on. The session ends when the caller's commands end and
its requests have finished, when the pod drains and none is open, or when the call is
cancelled (every open request is then cancelled, which frees its KV).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from baton.api import convert
from baton.api.requests import GenerationStep
from baton.api.v1 import decode_pb2
from baton.decode.answers import failure_answer
from baton.decode.streams import RequestStream

# What a session borrows from the pod's servicer (passed in: the servicer owns sessions, a
# session knows no servicer): open a request's stream, and read it as its own call would.
OpenStream = Callable[[object], Awaitable[RequestStream]]
ReadSteps = Callable[[RequestStream], AsyncIterator[tuple[GenerationStep, bool]]]

log = logging.getLogger(__name__)


class PodSession:
    def __init__(self, open_stream: OpenStream, read_steps: ReadSteps,
                 draining: Callable[[], bool]) -> None:
        self._open_stream = open_stream
        self._read_steps = read_steps
        self._draining = draining
        # The next message, its steps filled in place as they come (see ``convert.fill_step``).
        self._outbox = decode_pb2.SessionSteps()
        self._ready = asyncio.Event()
        self._tasks: dict[int, asyncio.Task] = {}

    def wake(self) -> None:
        self._ready.set()

    async def run(self, commands: AsyncIterator[decode_pb2.SessionCommand]
                  ) -> AsyncIterator[decode_pb2.SessionSteps]:
        """The call's messages: each holds every step taken since the last one."""
        reader = asyncio.ensure_future(self._read(commands))
        try:
            while True:
                if self._outbox.steps:
                    message, self._outbox = self._outbox, decode_pb2.SessionSteps()
                    yield message
                elif not self._tasks and (reader.done() or self._draining()):
                    return
                else:
                    self._ready.clear()  # no await since the checks: a change sets it after
                    await self._ready.wait()
        finally:
            reader.cancel()
            if self._tasks and self._draining():
                # The grace of a draining pod ended with these open: the gateway moves them.
                log.info("draining: %d open requests cut when the grace ended", len(self._tasks))
            for task in list(self._tasks.values()):
                task.cancel()

    async def _read(self, commands: AsyncIterator[decode_pb2.SessionCommand]) -> None:
        try:
            async for command in commands:
                self._take(command)
        except (grpc.RpcError, asyncio.CancelledError):
            pass  # the call is over; run() ends with it
        finally:
            self._ready.set()

    def _take(self, command: decode_pb2.SessionCommand) -> None:
        number, kind = command.stream, command.WhichOneof("command")
        if kind == "cancel":
            task = self._tasks.get(number)
            if task is not None:
                task.cancel()
        elif kind is None:
            self._emit_failure(number, ValueError(
                f"session command for stream {number} opens nothing (generate or attach) and "
                f"cancels nothing"))
        elif number in self._tasks:
            self._emit_failure(number, ValueError(f"stream {number} is already open on this session"))
        else:
            request = command.generate if kind == "generate" else command.attach
            self._tasks[number] = asyncio.ensure_future(self._serve(number, request))

    async def _serve(self, number: int, request) -> None:
        try:
            stream = await self._open_stream(request)
            async for step, first in self._read_steps(stream):
                convert.fill_step(self._outbox.steps.add(stream=number).step, step, first)
                self._ready.set()
        except Exception as e:  # noqa: BLE001 - it answers this request, the others go on
            self._emit_failure(number, e)
        finally:
            self._tasks.pop(number, None)
            self._ready.set()

    def _emit_failure(self, number: int, error: BaseException) -> None:
        code, message = failure_answer(error)
        self._outbox.steps.add(stream=number, code=code.value[0], message=message)
        self._ready.set()
