"""One request's trip through the pods the policy picked, as the client's stream of steps.

Two paths (docs/architecture.md, "A request's path"):

* local: ``Decode.Generate`` on the decode pod, relayed as it streams;
* chain: ``Prefill.Prefill`` on the chain's rank 0 — its first event is the tail's first
  token, sent to the client at once (TTFT is the chain's), its second that the KV sits on
  the decode pod — then ``Decode.Attach`` streams the tokens after the first.

The relay fills in what only it knows on the last step: the route, and the chain's share of
usage and timings (bytes shipped, prefill and push time). Errors are downstream
``grpc.RpcError``s; the servicer turns them into the client's status. Every downstream call
is registered on the ``LiveRequest`` so a cancellation reaches it. Everything here runs on
the gateway's event loop (``grpc.aio`` channels, one per pod, shared by every request).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator

import grpc

from baton.api import convert
from baton.api.requests import (
    DecodeRequest,
    GenerateRequest,
    GenerationStep,
    PrefillFirstToken,
    PrefillRequest,
    PrefillShipped,
    Route,
    Timings,
    Usage,
)
from baton.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from baton.gateway.request_table import LiveRequest
from baton.gateway.routing_policy import RouteDecision
from baton.model.tokenizer import IncrementalDecoder, Tokenizer
from baton.routing import RequestRecord
from baton.serving import GRPC_OPTIONS

ABORT_TIMEOUT_S = 5.0  # an Abort to a pod that does not answer in this long is given up


class ChainIncomplete(RuntimeError):
    """A chain closed its stream without the first token or the shipped KV (UNAVAILABLE)."""


class Channels:
    """One gRPC channel per pod address, reused by every request (a channel multiplexes).
    Used only on the gateway's event loop, which its channels belong to."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        return self._channels[address]

    def decode(self, address: str) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self._channel(address))

    def prefill(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        return prefill_pb2_grpc.PrefillStub(self._channel(address))

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


class Relay:
    def __init__(self, channels: Channels, tokenizer: Tokenizer, model_id: str,
                 kv_wait_s: float) -> None:
        self.channels = channels
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.kv_wait_s = kv_wait_s

    def stream(self, live: LiveRequest, request: GenerateRequest, prompt_ids: tuple[int, ...],
               decision: RouteDecision) -> AsyncIterator[GenerationStep]:
        if decision.chain is None:
            return self._local(live, request, prompt_ids, decision)
        return self._through_chain(live, request, prompt_ids, decision)

    async def _local(self, live: LiveRequest, request: GenerateRequest, prompt_ids: tuple[int, ...],
                     decision: RouteDecision) -> AsyncIterator[GenerationStep]:
        decode_request = DecodeRequest(request_id=live.request_id, prompt_token_ids=prompt_ids,
                                       sampling=request.sampling, compression=request.compression)
        call = self.channels.decode(decision.decode.address).Generate(
            convert.decode_request_to_proto(decode_request))
        live.watch(call)
        route = Route(decode_address=decision.decode.address)
        async for message in call:
            step = convert.step_from_proto(message)
            yield dataclasses.replace(step, route=route) if step.finish_reason else step

    async def _through_chain(self, live: LiveRequest, request: GenerateRequest,
                             prompt_ids: tuple[int, ...], decision: RouteDecision
                             ) -> AsyncIterator[GenerationStep]:
        prefill_request = PrefillRequest(
            request_id=live.request_id, model=self.model_id, prompt_token_ids=prompt_ids,
            sampling=request.sampling, compression=request.compression,
            decode_address=decision.decode.address)
        call = self.channels.prefill(decision.chain.address).Prefill(
            convert.prefill_request_to_proto(prefill_request))
        live.watch(call)
        first: PrefillFirstToken | None = None
        shipped: PrefillShipped | None = None
        first_text = ""
        async for message in call:
            event = convert.prefill_event_from_proto(message)
            if isinstance(event, PrefillFirstToken):
                first = event
                first_text = self._first_token_text(event.token_id, request)
                yield GenerationStep(live.request_id, token_ids=(event.token_id,), text=first_text)
            else:
                shipped = event
        if first is None or shipped is None:
            raise ChainIncomplete(f"chain {decision.chain.chain_id} ended request "
                                  f"{live.request_id!r} without its first token and KV")
        route = Route(decode_address=decision.decode.address, chain_id=decision.chain.chain_id,
                      partition=first.partition)
        attach = self.channels.decode(decision.decode.address).Attach(
            decode_pb2.AttachRequest(request_id=live.request_id, wait_s=self.kv_wait_s))
        live.watch(attach)
        # The pod's first step repeats the first token's text (it owns the detokenizer and
        # leaves out only the token id); the client already has what we showed of it.
        shown = first_text
        async for message in attach:
            step = convert.step_from_proto(message)
            if shown and step.text:
                overlap = len(os.path.commonprefix([shown, step.text]))
                step = dataclasses.replace(step, text=step.text[overlap:])
                shown = shown[overlap:]
            if step.finish_reason:
                step = _with_chain_summary(step, shipped, route)
            yield step

    def _first_token_text(self, token_id: int, request: GenerateRequest) -> str:
        """The first token's text when it can be shown at once. With stop strings the decode
        pod's matcher decides what text is released, so the gateway shows none of its own."""
        if request.sampling.stop:
            return ""
        return IncrementalDecoder(self.tokenizer).push(token_id)

    async def abort_pods(self, record: RequestRecord) -> bool:
        """Abort a request on every pod that may hold state for it (the chain first, so it
        pushes nothing more, then the decode pod); True when any pod held some. A pod that
        cannot be reached holds nothing that outlives it (its state dies with it or by TTL)."""
        stubs = [self.channels.decode(record.decode_address)]
        if record.prefill_address:
            stubs.insert(0, self.channels.prefill(record.prefill_address))
        found = False
        for stub in stubs:
            try:
                answer = await stub.Abort(common_pb2.AbortRequest(request_id=record.request_id),
                                          timeout=ABORT_TIMEOUT_S)
            except grpc.RpcError:
                continue
            found = found or answer.found
        return found


def _with_chain_summary(step: GenerationStep, shipped: PrefillShipped, route: Route
                        ) -> GenerationStep:
    """The last step of a chain request: the chain's KV figures and times beside the pod's."""
    usage = step.usage or Usage()
    usage = dataclasses.replace(
        usage, kv_bytes_shipped=usage.kv_bytes_shipped or shipped.kv_bytes,
        kv_tokens_kept=usage.kv_tokens_kept or shipped.kv_tokens_kept,
        kv_tokens_full=usage.kv_tokens_full or shipped.kv_tokens_full)
    timings = dataclasses.replace(step.timings or Timings(), prefill_s=shipped.prefill_s,
                                  kv_push_s=shipped.kv_push_s)
    return dataclasses.replace(step, usage=usage, timings=timings, route=route)
