"""``AsyncBatonClient`` against the session's cluster: concurrent streams on one event loop
give the monolithic engine's tokens, as the blocking client does; its unary calls answer as
the blocking client's; a cancelled stream frees its KV; bad input arrives as its status."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from baton.api.requests import CompressionParams, FinishReason, GenerateRequest
from baton.client import AsyncBatonClient
from baton.sampling.params import SamplingParams
from e2e_cluster import CHAIN_THRESHOLD_TOKENS, all_kv_free, greedy, long_prompt_ids, wait_until

pytestmark = pytest.mark.slow
PROMPTS = ("import os\n\ndef main():\n", "class Stack:\n", "def fibonacci(n):\n",
           "for line in open(path):\n")
OUT_OF_VOCABULARY = 999_999  # a token id past any vocabulary the tests use


def test_concurrent_async_streams_equal_the_monolithic_engine(cluster, client, reference):
    long_ids = tuple(long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 40))
    requests = [GenerateRequest(text=prompt, sampling=greedy(10)) for prompt in PROMPTS]
    # pinned: an earlier test may have left this prompt in a decode pod's prefix cache
    requests.append(GenerateRequest(token_ids=long_ids, sampling=greedy(10),
                                    compression=CompressionParams(enabled=False),
                                    prefill_route="chain"))

    async def run():
        async with AsyncBatonClient(cluster.gateway_address) as aio:
            await aio.wait_until_serving(timeout_s=30)
            completions = await asyncio.gather(*(aio.generate(r, timeout_s=60) for r in requests))
            return completions, await aio.tokenize(PROMPTS[0]), await aio.list_models()

    completions, tokenization, models = asyncio.run(run())
    for request, completion in zip(requests, completions, strict=True):
        prompt_ids = request.token_ids or reference.tokenizer.encode(request.text)
        assert completion.token_ids == reference.tokens(list(prompt_ids), 10)
        assert completion.text == reference.tokenizer.decode(completion.token_ids)
        assert completion.request_id and completion.last.finish_reason in (FinishReason.LENGTH,
                                                                           FinishReason.STOP)
    assert completions[-1].last.route.chain_id  # the long prompt went through the chain
    assert tokenization == client.tokenize(PROMPTS[0])
    assert models == client.list_models()


def test_a_cancelled_async_stream_frees_the_kv_on_the_decode_pod(cluster, client):
    async def run() -> int:
        async with AsyncBatonClient(cluster.gateway_address) as aio:
            stream = aio.stream(GenerateRequest(text=PROMPTS[1], sampling=SamplingParams(
                temperature=0.0, max_tokens=600, ignore_eos=True)), timeout_s=60)
            received = 0
            with pytest.raises(asyncio.CancelledError):
                async for step in stream:
                    received += len(step.token_ids)
                    if received >= 3:
                        stream.cancel()
            return received

    assert asyncio.run(run()) >= 3
    wait_until(lambda: all_kv_free(cluster), 10, "the decode pod to free a cancelled request")


def test_bad_input_reaches_an_async_caller_as_its_status_and_the_client_goes_on(cluster):
    async def run():
        async with AsyncBatonClient(cluster.gateway_address) as aio:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await aio.generate(GenerateRequest(token_ids=(5, OUT_OF_VOCABULARY)), timeout_s=30)
            found = await aio.abort("no-such-request")
            after = await aio.generate(GenerateRequest(text=PROMPTS[2], sampling=greedy(3)))
            return error.value, found, after

    error, found, after = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(OUT_OF_VOCABULARY) in error.details()
    assert found is False
    assert len(after.token_ids) == 3
