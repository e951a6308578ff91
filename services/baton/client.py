"""The gRPC clients of baton's API (``baton generate --server``, ``baton up --demo``, the
end-to-end tests and the serving benchmark).

``BatonClient`` (blocking calls, any threads) and ``AsyncBatonClient`` (asyncio: calls
are coroutines, streams async iterators) speak domain objects (``baton.api.requests``)
and hide the protobuf messages; a server's error arrives as ``grpc.RpcError`` with the
server's status code and message. ``generate_to_terminal`` is the ``baton generate
--server`` path: the same output contract as a local run (streamed text, or one
``{"token_ids": [...], "text": "..."}`` line per prompt with ``--json``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.api import convert
from baton.api.requests import GenerateRequest, GenerationStep, ModelInfo, Tokenization
from baton.api.v1 import api_pb2, api_pb2_grpc, common_pb2
from baton.sampling.params import SamplingParams

SERVICE_NAME = "baton.v1.Baton"
HEALTH_CHECK = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
SERVING = health_pb2.HealthCheckResponse.SERVING
# A health service that answered with an error (not "unavailable", which a new watch waits
# out for the connection) cannot say when that changes: it is asked again this long after.
HEALTH_ERROR_RETRY_S = 0.5


def _not_serving(address: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(f"{address} is not serving after {timeout_s:g} s")


def _retry_after_s(error: grpc.RpcError | None, address: str, timeout_s: float) -> float:
    """How long to wait before watching health again after a watch ended (``error``: how;
    None: the server closed it): raises TimeoutError when the deadline ended it."""
    if error is None:
        return HEALTH_ERROR_RETRY_S
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        raise _not_serving(address, timeout_s) from None
    return 0.0 if error.code() == grpc.StatusCode.UNAVAILABLE else HEALTH_ERROR_RETRY_S


def _channel(module, address: str, tls: bool, tls_ca_file: str | None,
             tls_server_name: str | None):
    """A channel of ``module`` (``grpc`` or ``grpc.aio``): TLS when ``tls`` or a CA file is
    given (the CA's PEM, else the system's roots), ``tls_server_name`` the name the gateway's
    certificate must carry when it is not the address's host."""
    if not (tls or tls_ca_file):
        if tls_server_name:
            raise ValueError(f"tls_server_name {tls_server_name!r} needs TLS (tls or tls_ca_file)")
        return module.insecure_channel(address)
    roots = Path(tls_ca_file).read_bytes() if tls_ca_file else None
    options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
    return module.secure_channel(address, grpc.ssl_channel_credentials(roots), options=options)


def _call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """What every call carries: the API key as the gateway reads it (``authorization``)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


@dataclass
class Completion:
    """A whole generation as the client saw it: the steps joined, and when each arrived."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    last: GenerationStep | None = None  # finish reason, usage, timings, route
    ttft_s: float = 0.0  # measured by the client: call start to the first token
    token_times_s: list[float] = field(default_factory=list)  # arrival of each message with tokens

    def add(self, step: GenerationStep, now_s: float, start_s: float) -> None:
        self.request_id = step.request_id or self.request_id  # named in the first message
        if step.token_ids:
            if not self.token_ids:
                self.ttft_s = now_s - start_s
            self.token_times_s.append(now_s)
        self.token_ids.extend(step.token_ids)
        self.text += step.text
        if step.finish_reason is not None:
            self.last = step


class BatonClient:
    """One channel to a gateway. It carries any number of concurrent calls from any threads
    (HTTP/2 streams on one connection): share one client rather than opening one per call,
    which costs a connection each and more CPU per streamed token (docs/runtime.md).

    ``api_key`` goes with every call (a gateway with ``auth.api_keys_file`` wants one);
    ``tls`` or ``tls_ca_file`` (the PEM of the CA that signed the gateway's certificate)
    reach a gateway that serves TLS (``server.tls_cert``)."""

    def __init__(self, address: str, *, api_key: str | None = None, tls: bool = False,
                 tls_ca_file: str | None = None, tls_server_name: str | None = None) -> None:
        self.address = address
        self.channel = _channel(grpc, address, tls, tls_ca_file, tls_server_name)
        self.stub = api_pb2_grpc.BatonStub(self.channel)
        self.metadata = _call_metadata(api_key)

    def wait_until_serving(self, timeout_s: float) -> None:
        """Block until the server's health says SERVING (TimeoutError after timeout_s).

        Watches the health service (a stream of its status changes) rather than asking it
        again and again; ``wait_for_ready`` holds the watch until the connection is up."""
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout_s
        while (remaining_s := deadline - time.monotonic()) > 0:
            watch = health.Watch(HEALTH_CHECK, timeout=remaining_s, wait_for_ready=True)
            error = None
            try:
                if any(answer.status == SERVING for answer in watch):
                    return
            except grpc.RpcError as e:
                error = e
            finally:
                watch.cancel()
            retry_s = _retry_after_s(error, self.address, timeout_s)
            if retry_s:
                time.sleep(min(retry_s, max(0.0, deadline - time.monotonic())))  # retry back-off
        raise _not_serving(self.address, timeout_s)

    def stream(self, request: GenerateRequest, timeout_s: float | None = None):
        """The streaming call; iterate it for GenerationSteps, ``cancel()`` it to stop."""
        return _StepStream(self.stub.Generate(convert.generate_request_to_proto(request),
                                              timeout=timeout_s, metadata=self.metadata))

    def generate(self, request: GenerateRequest, timeout_s: float | None = None) -> Completion:
        completion = Completion()
        start_s = time.monotonic()
        for step in self.stream(request, timeout_s):
            completion.add(step, time.monotonic(), start_s)
        return completion

    def tokenize(self, text: str, model: str = "") -> Tokenization:
        return convert.tokenization_from_proto(self.stub.Tokenize(
            api_pb2.TokenizeRequest(model=model, text=text), metadata=self.metadata))

    def list_models(self) -> list[ModelInfo]:
        return convert.models_from_proto(self.stub.ListModels(api_pb2.ListModelsRequest(),
                                                              metadata=self.metadata))

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(common_pb2.AbortRequest(request_id=request_id),
                               metadata=self.metadata).found

    def close(self) -> None:
        self.channel.close()


class _StepStream:
    """A Generate call that yields domain steps (iterate a blocking call, ``async for`` an
    aio one) and can be cancelled."""

    def __init__(self, call) -> None:
        self.call = call

    def __iter__(self) -> Iterator[GenerationStep]:
        for message in self.call:
            yield convert.step_from_proto(message)

    def __aiter__(self) -> AsyncIterator[GenerationStep]:
        return self._steps()

    async def _steps(self) -> AsyncIterator[GenerationStep]:
        async for message in self.call:
            yield convert.step_from_proto(message)

    def cancel(self) -> None:
        self.call.cancel()


class AsyncBatonClient:
    """``BatonClient`` for asyncio applications: one ``grpc.aio`` channel, made and used on
    one event loop, carrying any number of concurrent calls. Many streams on one loop cost
    about half the client CPU per streamed token of as many threads on a ``BatonClient``
    (docs/runtime.md). ``async with`` closes it. The keyword arguments are
    ``BatonClient``'s."""

    def __init__(self, address: str, *, api_key: str | None = None, tls: bool = False,
                 tls_ca_file: str | None = None, tls_server_name: str | None = None) -> None:
        self.address = address
        self.channel = _channel(grpc.aio, address, tls, tls_ca_file, tls_server_name)
        self.stub = api_pb2_grpc.BatonStub(self.channel)
        self.metadata = _call_metadata(api_key)

    async def wait_until_serving(self, timeout_s: float) -> None:
        """Until the server's health says SERVING (TimeoutError after timeout_s); watches it
        as ``BatonClient.wait_until_serving`` does."""
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout_s
        while (remaining_s := deadline - time.monotonic()) > 0:
            watch = health.Watch(HEALTH_CHECK, timeout=remaining_s, wait_for_ready=True)
            error = None
            try:
                async for answer in watch:
                    if answer.status == SERVING:
                        return
            except grpc.RpcError as e:
                error = e
            finally:
                watch.cancel()
            retry_s = _retry_after_s(error, self.address, timeout_s)
            if retry_s:
                await asyncio.sleep(min(retry_s, max(0.0, deadline - time.monotonic())))  # back-off
        raise _not_serving(self.address, timeout_s)

    def stream(self, request: GenerateRequest, timeout_s: float | None = None) -> _StepStream:
        """The streaming call; ``async for`` it for GenerationSteps, ``cancel()`` it to stop."""
        return _StepStream(self.stub.Generate(convert.generate_request_to_proto(request),
                                              timeout=timeout_s, metadata=self.metadata))

    async def generate(self, request: GenerateRequest, timeout_s: float | None = None) -> Completion:
        completion = Completion()
        start_s = time.monotonic()
        async for step in self.stream(request, timeout_s):
            completion.add(step, time.monotonic(), start_s)
        return completion

    async def tokenize(self, text: str, model: str = "") -> Tokenization:
        return convert.tokenization_from_proto(await self.stub.Tokenize(
            api_pb2.TokenizeRequest(model=model, text=text), metadata=self.metadata))

    async def list_models(self) -> list[ModelInfo]:
        return convert.models_from_proto(await self.stub.ListModels(api_pb2.ListModelsRequest(),
                                                                    metadata=self.metadata))

    async def abort(self, request_id: str) -> bool:
        return (await self.stub.Abort(common_pb2.AbortRequest(request_id=request_id),
                                      metadata=self.metadata)).found

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def generate_to_terminal(client: BatonClient, prompts: Sequence[str | list[int]],
                         params: SamplingParams, as_json: bool) -> int:
    """Generate each prompt on ``client``'s gateway, printing as a local run would; closes
    the client."""
    address = client.address
    try:
        for index, prompt in enumerate(prompts):
            request = (GenerateRequest(text=prompt, sampling=params) if isinstance(prompt, str)
                       else GenerateRequest(token_ids=tuple(prompt), sampling=params))
            stream_text = not as_json and len(prompts) == 1
            completion = Completion()
            start_s = time.monotonic()
            for step in client.stream(request):
                completion.add(step, time.monotonic(), start_s)
                if stream_text:
                    sys.stdout.write(step.text)
                    sys.stdout.flush()
            if as_json:
                print(json.dumps({"token_ids": completion.token_ids, "text": completion.text}))
            elif stream_text:
                sys.stdout.write("\n")
            else:
                print(f"--- [{index}] {prompt!r}")
                print(completion.text)
    except grpc.RpcError as e:
        raise ValueError(f"server {address}: {e.code().name}: {e.details()}") from e
    finally:
        client.close()
    return 0
