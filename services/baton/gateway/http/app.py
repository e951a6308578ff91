"""The gateway's OpenAI-compatible HTTP API (aiohttp), on the gRPC server's event loop.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(and ``/v1/models/{id}``), ``GET /health`` (200 only while a request could be routed),
``GET /metrics`` (the gateway's Prometheus registry, then ``http.metrics_textfile``'s
samples). Generation goes through a ``Router``: on the gateway the same ``Generations`` as
gRPC (the same checks, routes, limits, migration and aborts); on a decode pod serving its
own door (an InferencePool endpoint) ``baton.decode.door.PodRouter``.

Streaming answers are Server-Sent Events: ``data: {chunk}`` per step, ``data: [DONE]`` at
the end. Errors before the first chunk get their HTTP status and OpenAI's error body;
after it, an error chunk then ``[DONE]``. A client that disconnects has its handler
cancelled (``handler_cancellation``), which aborts the request on every pod; one that stops
reading is cut off after ``gateway.stall_s`` and its request aborted the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from baton import tracing
from baton.api.requests import FinishReason, GenerateRequest, GenerationStep
from baton.config import HttpConfig
from baton.errors import InvalidArgument, ResourceExhausted
from baton.gateway.http.answers import Answer, Choice, returned_choices, total_usage
from baton.gateway.http.chat_output import ChatOutput
from baton.gateway.http.chat_template import ChatTemplate
from baton.gateway.http.choice_stream import ChoiceStream
from baton.gateway.http.errors import error_fields, error_response, http_status
from baton.gateway.http.events import EventStream
from baton.gateway.http.generation_plan import PlannedGeneration, plan_generations
from baton.gateway.http.model_routes import ModelRoutes
from baton.gateway.http.protocol import BadParameter, Completion, chat_request, completion_request
from baton.gateway.served_model import ServedModel
from baton.security.api_keys import ApiKeys

log = logging.getLogger(__name__)

IDENTITY = web.RequestKey("identity", str)  # whose API key the request came with ("" = no keys)


def _read_textfile(path: str) -> bytes:
    """A Prometheus text file's samples ("" while it does not exist), newline-terminated."""
    try:
        with open(path, "rb") as file:
            text = file.read()
    except FileNotFoundError:
        return b""
    return text if not text or text.endswith(b"\n") else text + b"\n"


class Router(Protocol):
    """What the door needs behind it: the model it serves (its checks and tokenizer), a
    request's steps (the first names its id; admission errors are raised before it) and a
    count of the requests refused before routing."""

    model: ServedModel

    def generate(self, request: GenerateRequest, arrival: float, owner: str = "",
                 made_id: bool = False, traceparent: str = "") -> AsyncIterator[GenerationStep]: ...

    def count_refused(self, error: Exception) -> None: ...


class OpenAIServer:
    """The HTTP API of one gateway (or decode pod); ``start`` and ``stop`` run on its loop."""

    def __init__(self, config: HttpConfig, generations: Router, keys: ApiKeys,
                 chat_template: ChatTemplate | None, registry, ready: Callable[[], bool],
                 max_streams: int, max_body_bytes: int, stall_s: float) -> None:
        self.config = config
        self.generations = generations
        self.model = generations.model
        self.keys = keys
        self.chat_template = chat_template
        self.registry = registry
        self.ready = ready
        self.max_streams = max_streams
        self.max_body_bytes = max_body_bytes
        self.stall_s = stall_s
        self.streams = 0
        self._idle = asyncio.Event()  # set while no request is open: what stop() waits for
        self._idle.set()
        self.app = web.Application(client_max_size=max_body_bytes,
                                   middlewares=[self._errors, self._authenticate])
        self.app.add_routes([web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat_completions),
                             *ModelRoutes(self.model, chat_template).routes(),
                             web.get("/health", self.health),
                             web.get("/metrics", self.metrics)])
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> int:
        """Bind ``host:port`` and serve; returns the port bound."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=0.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("OpenAI HTTP API on http://%s:%d/v1", self.config.host, self.port)
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Stop taking connections; open requests get ``grace_s`` to finish, then are
        cancelled (which aborts them on the pods)."""
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        for site in list(runner.sites):
            await site.stop()
        try:
            async with asyncio.timeout(grace_s):
                await self._idle.wait()
        except TimeoutError:
            pass
        await runner.cleanup()  # cancels what is still open

    # --- middleware -----------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error as OpenAI's error body with its status; a bug is a 500 and logged."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status == 413:
                return error_response(413, f"the request body is larger than "
                                           f"{self.max_body_bytes} bytes")
            if e.status < 400:
                raise
            return error_response(e.status, f"{request.method} {request.path}: {e.reason}")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            status = http_status(e)
            if status == 500:
                log.exception("%s %s failed", request.method, request.path)
            return error_response(status, str(e), *error_fields(e))

    @web.middleware
    async def _authenticate(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            request[IDENTITY] = self.keys.identify(request.headers.get("Authorization"))
        return await handler(request)

    # --- endpoints ------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.ready():
            return web.json_response({"status": "ok"})
        return error_response(503, "no decode pod is live: requests cannot be routed now")

    async def metrics(self, request: web.Request) -> web.Response:
        """The gateway's registry, then the samples of ``http.metrics_textfile`` if it names
        one (read off the loop; a file not written yet adds nothing)."""
        extra = b""
        if self.config.metrics_textfile:
            extra = await asyncio.get_running_loop().run_in_executor(
                None, _read_textfile, self.config.metrics_textfile)
        return web.Response(body=generate_latest(self.registry) + extra,
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, completion_request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat_request)

    # --- generation -----------------------------------------------------------------------

    async def _generate(self, request: web.Request, read) -> web.StreamResponse:
        arrival = time.monotonic()
        if self.streams >= self.max_streams:
            error = ResourceExhausted(f"this gateway is streaming {self.streams} requests, its "
                                      f"limit (server.max_streams); retry later")
            self.generations.count_refused(error)
            raise error
        self.streams += 1  # taken before the first await: concurrent requests see it
        self._idle.clear()
        try:
            try:
                completion = read(await self._json(request), self.model.sampling_defaults)
                if completion.chat and self.chat_template is None:
                    raise BadParameter("messages", f"model {self.model.info.id!r} has no chat "
                                                   f"template: use /v1/completions")
                self.model.check_name(completion.model)
                named = request.headers.get("X-Request-Id")
                request_id = named or f"{'chatcmpl' if completion.chat else 'cmpl'}-{uuid.uuid4().hex}"
                planned = await asyncio.get_running_loop().run_in_executor(
                    None, plan_generations, completion, request_id, self.model, self.chat_template)
            except Exception as e:
                self.generations.count_refused(e)
                raise
            answer = Answer(chat=completion.chat, response_id=request_id, model=self.model.info.id,
                            created=int(time.time()), token_text=self.model.token_text,
                            logprobs=completion.logprobs is not None, echo=completion.echo,
                            prompt_logprobs=completion.prompt_logprobs is not None)
            owner = request[IDENTITY]
            if len(planned) > 1:
                return await self._several(request, answer, completion, planned, arrival, owner)
            async with aclosing(self.generations.generate(
                    planned[0].request, arrival, owner, made_id=not named,
                    traceparent=tracing.checked(request.headers.get(tracing.TRACEPARENT)))) as steps:
                first = await anext(steps)  # admission errors are raised here, as HTTP statuses
                if completion.stream:
                    return await self._stream(request, answer, completion, planned[0], first, steps)
                choice = await self._gather(planned[0], first, steps, completion.max_tokens == 0,
                                            self._chat_output(completion, planned[0]))
                return web.json_response(answer.whole(returned_choices([choice], completion),
                                                      choice.last.usage, completion.return_token_ids))
        finally:
            self.streams -= 1
            if not self.streams:
                self._idle.set()

    async def _json(self, request: web.Request) -> object:
        try:
            return await request.json()
        except web.HTTPException:
            raise
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidArgument(f"the request body is not valid JSON: {e}") from None

    @staticmethod
    async def _gather(planned: PlannedGeneration, first: GenerationStep, steps,
                      echo_only: bool = False, output: ChatOutput | None = None) -> Choice:
        """One generation, whole (``echo_only``: max_tokens 0, the token generated for it
        left out)."""
        choice = Choice(planned.index, first, prompt_ids=planned.prompt_ids,
                        prompt_text=planned.prompt_text, prompt_logprobs=first.prompt_logprobs,
                        chat_output=output)
        step = first
        while True:
            choice.text += step.text
            choice.token_ids += step.token_ids
            choice.logprobs += step.logprobs
            choice.last = step
            if step.finish_reason is not None:
                if echo_only:
                    choice.text, choice.token_ids, choice.logprobs = "", [], []
                    choice.last = dataclasses.replace(step, finish_reason=FinishReason.LENGTH)
                return choice
            step = await anext(steps)

    async def _several(self, request: web.Request, answer: Answer, completion: Completion,
                       planned: list[PlannedGeneration], arrival: float, owner: str
                       ) -> web.StreamResponse:
        """n, best_of or several prompts: the generations run side by side; the first
        failure to admit one fails the request (the others are aborted)."""
        async with contextlib.AsyncExitStack() as stack:
            traceparent = tracing.checked(request.headers.get(tracing.TRACEPARENT))
            streams = [await stack.enter_async_context(aclosing(self.generations.generate(
                plan.request, arrival, owner, made_id=True, traceparent=traceparent)))
                for plan in planned]
            firsts = [await anext(steps) for steps in streams]
            if completion.stream:
                return await self._stream_several(request, answer, completion, planned, firsts,
                                                  streams)
            choices = await asyncio.gather(*(
                self._gather(plan, first, steps, completion.max_tokens == 0,
                             self._chat_output(completion, plan))
                for plan, first, steps in zip(planned, firsts, streams)))
            return web.json_response(answer.whole(returned_choices(choices, completion),
                                                  total_usage(choices, completion),
                                                  completion.return_token_ids))

    async def _stream(self, request: web.Request, answer: Answer, completion: Completion,
                      planned: PlannedGeneration, first: GenerationStep, steps) -> web.StreamResponse:
        events = EventStream(request, answer.response_id, self.stall_s)
        await events.open()
        choice = ChoiceStream(answer, completion, planned, 0, self._chat_output(completion, planned))
        step = first
        try:
            while True:
                for chunk in choice.chunks(step):
                    await events.send(chunk)
                if step.finish_reason is not None:
                    if completion.include_usage:
                        await events.send(answer.usage_chunk(step))
                    break
                step = await anext(steps)
        except ConnectionError:  # the client left: closing ``steps`` aborts the request
            return events.response
        except Exception as e:  # noqa: BLE001 - told to the client in the stream (and logged)
            await events.fail(e)
        return await events.close()

    async def _stream_several(self, request: web.Request, answer: Answer, completion: Completion,
                              planned: list[PlannedGeneration], firsts: list[GenerationStep],
                              streams: list) -> web.StreamResponse:
        """Chunks of every choice as their steps come (each chunk names its choice)."""
        events = EventStream(request, answer.response_id, self.stall_s)
        await events.open()
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, first: GenerationStep, steps) -> None:
            try:
                step = first
                await queue.put((index, step))
                while step.finish_reason is None:
                    step = await anext(steps)
                    await queue.put((index, step))
            except Exception as e:  # noqa: BLE001 - the stream reports it, as one choice's end
                await queue.put((index, e))

        choices = [ChoiceStream(answer, completion, plan, plan.index,
                                self._chat_output(completion, plan)) for plan in planned]
        lasts: dict[int, GenerationStep] = {}
        async with asyncio.TaskGroup() as group:
            pumps = [group.create_task(pump(index, first, steps))
                     for index, (first, steps) in enumerate(zip(firsts, streams))]
            try:
                while len(lasts) < len(planned):
                    index, step = await queue.get()
                    if isinstance(step, Exception):
                        raise step
                    for chunk in choices[index].chunks(step):
                        await events.send(chunk)
                    if step.finish_reason is not None:
                        lasts[index] = step
                if completion.include_usage:
                    gathered = [Choice(i, last) for i, last in sorted(lasts.items())]
                    await events.send(answer.usage_chunk(gathered[0].last,
                                                         total_usage(gathered, completion)))
            except ConnectionError:
                return events.response
            except Exception as e:  # noqa: BLE001 - told to the client in the stream (and logged)
                await events.fail(e)
            finally:
                for task in pumps:
                    task.cancel()
        return await events.close()

    def _chat_output(self, completion: Completion, planned: PlannedGeneration) -> ChatOutput | None:
        """How a chat choice's text becomes its message (None for a completion)."""
        if not completion.chat:
            return None
        source = self.chat_template.source_of(completion.chat_template)
        return ChatOutput.for_request(completion.tools, source, planned.prompt_text,
                                      completion.template_kwargs, self.config.tool_call_parser)

