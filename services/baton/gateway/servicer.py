"""The client API (``baton.v1.Baton``) served by the gateway over gRPC: convert, generate,
convert back.

Generate: read and check the request (INVALID_ARGUMENT with the numbers), then stream the
steps of ``Generations.generate`` (UNAVAILABLE when no decode pod is live, RESOURCE_EXHAUSTED
when all are full, ALREADY_EXISTS for a live duplicate id; an aborted stream still ends with
a last message whose finish reason is ABORTED). A client that cancels, or an Abort naming
the request, reaches every pod that holds state for it. Tokenize and ListModels are answered
here. Nothing a request does can stop the server: every error becomes the call's status.
A client that stops reading holds its call only until its HTTP/2 window is full and then for
``stall_s`` more: the call then ends DEADLINE_EXCEEDED (which the client sees once it reads
again) and the request is aborted on its pods, as a cancelled one is.

The handlers are coroutines on the server's event loop: a stream costs no thread. Work that
blocks (tokenizing, reading and writing the routing store) runs in the loop's executor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

import grpc

from baton import tracing
from baton.api import convert
from baton.api.v1 import api_pb2, api_pb2_grpc, common_pb2
from baton.errors import PermissionDenied, Unauthenticated
from baton.gateway.generations import Generations
from baton.security.api_keys import ApiKeys

log = logging.getLogger(__name__)


class BatonServicer(api_pb2_grpc.BatonServicer):
    def __init__(self, generations: Generations, keys: ApiKeys, stall_s: float) -> None:
        self.generations = generations
        self.model = generations.model
        self.keys = keys
        self.stall_s = stall_s

    async def _identify(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's identity from its ``authorization: Bearer KEY`` metadata ("" when the
        gateway has no keys); aborts the call UNAUTHENTICATED when the key is missing or wrong."""
        try:
            return self.keys.identify(dict(context.invocation_metadata() or ()).get("authorization"))
        except Unauthenticated as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))

    async def Generate(self, message: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> None:
        """Streams with ``context.write`` rather than ``yield``, so that each write can be
        bounded by ``stall_s``."""
        arrival = time.monotonic()
        owner = await self._identify(context)
        try:
            request = convert.generate_request_from_proto(message)
        except ValueError as e:
            self.generations.count_refused(e)
            await context.abort(convert.status_for(e), str(e))
        first = True
        try:
            traceparent = tracing.from_metadata(context.invocation_metadata())
            async with aclosing(self.generations.generate(request, arrival, owner,
                                                          traceparent=traceparent)) as steps:
                async for step in steps:
                    if not await self._write(context, convert.step_to_proto(step, first)):
                        return  # closing the steps aborts the request on its pods
                    first = False
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the API edge: every error becomes a status
            await context.abort(convert.status_for(e), str(e))

    async def _write(self, context: grpc.aio.ServicerContext,
                     response: common_pb2.GenerateResponse) -> bool:
        """Send one message; False when the client took nothing for ``stall_s``. The call's
        status is then set rather than sent with ``abort``: that would wait behind the
        unread messages, as the write did."""
        try:
            async with asyncio.timeout(self.stall_s):  # a scope, not wait_for: no task per message
                await context.write(response)
            return True
        except TimeoutError:
            log.warning("a gRPC client read nothing for %g s: cut off", self.stall_s)
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details(f"the client read nothing for {self.stall_s:g} s "
                                f"(gateway.stall_s): the request was aborted")
            return False

    async def Abort(self, message: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> common_pb2.AbortResponse:
        caller = await self._identify(context)
        try:
            found = await self.generations.abort(message.request_id, caller)
        except PermissionDenied as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        return common_pb2.AbortResponse(found=found)

    async def Tokenize(self, message: api_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
                       ) -> api_pb2.TokenizeResponse:
        await self._identify(context)
        try:
            tokenization = await asyncio.get_running_loop().run_in_executor(
                None, self.model.tokenize, message.model, message.text)
        except Exception as e:  # noqa: BLE001 - the API edge: every error becomes a status
            await context.abort(convert.status_for(e), str(e))
        return convert.tokenization_to_proto(tokenization)

    async def ListModels(self, message: api_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> api_pb2.ListModelsResponse:
        await self._identify(context)
        return convert.models_to_proto([self.model.info])
