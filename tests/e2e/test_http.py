"""The OpenAI HTTP API of the local cluster's gateway, driven by the real `openai` client:
completions and chat, streamed and not, on both paths; greedy text equals the gRPC API's
token for token, chat prompts are rendered as `transformers` renders them, usage counts
right, and a client that disconnects mid-stream frees the KV."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from baton.api.requests import CompressionParams, FinishReason, GenerateRequest
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.sampling.params import SamplingParams
from e2e_cluster import CHAIN_THRESHOLD_TOKENS, all_kv_free, long_prompt_ids, wait_until

pytestmark = pytest.mark.slow
PROMPT = "import os\n\ndef main():\n"



def grpc_greedy(client, max_tokens: int, **request) -> tuple[list[int], str]:
    completion = client.generate(GenerateRequest(
        **request, sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    return completion.token_ids, completion.text


def test_models_lists_the_served_model_with_its_context(api, client):
    (model,) = api.models.list().data
    (info,) = client.list_models()
    assert (model.id, model.owned_by, model.max_model_len) == (info.id, "baton", info.max_model_len)
    assert api.models.retrieve(info.id).id == info.id


@pytest.mark.parametrize("path", ["local", "chain"])
def test_greedy_completion_equals_the_grpc_api_token_for_token(api, client, reference, model_id, path):
    prompt_ids = (long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 40) if path == "chain"
                  else reference.tokenizer.encode(PROMPT))
    # compression off: the monolithic reference keeps the whole cache; the route pinned (the
    # second request would find the first's prompt in its decode pod's prefix cache)
    token_ids, text = grpc_greedy(client, 24, token_ids=tuple(prompt_ids), prefill_route=path,
                                  compression=CompressionParams(enabled=False))
    answer = api.completions.create(model=model_id, prompt=prompt_ids, max_tokens=24, temperature=0,
                                    extra_body={"return_token_ids": True, "prefill_route": path,
                                                "compression": {"enabled": False}})
    (choice,) = answer.choices
    assert choice.model_extra["token_ids"] == token_ids, "vLLM's return_token_ids extension"
    assert choice.text == text and choice.finish_reason == "length"
    assert token_ids == reference.tokens(list(prompt_ids), 24)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens,
            answer.usage.total_tokens) == (len(prompt_ids), 24, len(prompt_ids) + 24)
    assert answer.model_extra["baton"]["route"]["path"] == path
    assert answer.id.startswith("cmpl-") and answer.object == "text_completion"


def test_a_streamed_completion_is_the_same_text_with_usage_last(api, client, model_id):
    token_ids, text = grpc_greedy(client, 20, text=PROMPT)
    chunks = list(api.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"return_token_ids": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == token_ids
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stop_strings_end_the_completion_without_the_stop(api, client, model_id):
    _, text = grpc_greedy(client, 40, text=PROMPT)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    answer = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=40, temperature=0,
                                    stop=[stop])
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == text[:text.index(stop)]


def test_seeded_sampling_is_reproducible_across_both_apis(api, client, model_id):
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16)
    expected = client.generate(GenerateRequest(text=PROMPT, sampling=sampling)).text
    for stream in (False, True):
        answer = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=16,
                                        temperature=0.8, top_p=0.9, seed=1234, stream=stream)
        text = ("".join(c.choices[0].text for c in answer) if stream else answer.choices[0].text)
        assert text == expected


def test_chat_renders_the_template_as_transformers_does_and_streams_role_first(api, client, model_id):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Utilities for paths."},
                {"role": "user", "content": "Join two paths\nsafely"}]
    rendered = AutoTokenizer.from_pretrained(SHIPPED_MODEL_DIR).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    _, text = grpc_greedy(client, 12, text=rendered)
    answer = api.chat.completions.create(model=model_id, messages=messages, max_tokens=12,
                                         temperature=0)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == text
    assert answer.usage.completion_tokens == 12 and answer.object == "chat.completion"
    chunks = list(api.chat.completions.create(model=model_id, messages=messages, max_tokens=12,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == answer.usage.prompt_tokens


def test_chat_without_max_tokens_may_fill_the_context(api, client, reference, model_id):
    content = reference.tokenizer.decode(long_prompt_ids(reference.tokenizer, 900)).replace("\n", " ")
    answer = api.chat.completions.create(model=model_id, temperature=0, extra_body={"ignore_eos": True},
                                         messages=[{"role": "user", "content": content}])
    (info,) = client.list_models()
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.total_tokens == info.max_model_len, "up to the context, not a default limit"


@pytest.mark.parametrize("kwargs, status, param", [
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"temperature": -1}, 400, "temperature"),
    ({"n": 2, "best_of": 1}, 400, "best_of"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"echo": True, "logprobs": 1, "extra_body": {"prefill_route": "chain"}}, 400, None),
    ({"extra_body": {"min_tokens": 5}}, 400, "min_tokens"),
    ({"extra_body": {"logit_bias": {"99999": 1}}}, 400, None),
    ({"model": "gpt-9"}, 404, None),
    ({"prompt": "x" * 40_000}, 413, None),
    ({"prompt": [5] * 2000}, 400, None),
])
def test_each_bad_request_gets_its_status_and_openais_error_body(api, model_id, kwargs, status, param):
    request = {"model": model_id, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as error:
        api.completions.create(**request)
    assert error.value.status_code == status
    body = error.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    assert body["param"] == param
    if status == 404:
        assert body["code"] == "model_not_found" and "gpt-9" in body["message"]


def cancelled_streams(cluster) -> float:
    """The gateway's count of streams whose client went away before their end."""
    metrics = urllib.request.urlopen(cluster.gateway_http_url.removesuffix("/v1") + "/metrics")
    lines = [line for line in metrics.read().decode().splitlines()
             if line.startswith("baton_gateway_requests_finished_total{") and 'outcome="CANCELLED"' in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_a_client_that_disconnects_mid_stream_frees_the_kv(cluster, api, model_id):
    before = cancelled_streams(cluster)
    body = json.dumps({"model": model_id, "prompt": PROMPT, "max_tokens": 600, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"{cluster.gateway_http_url}/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        events = [response.readline() for _ in range(6)]  # three events and their blank lines
    assert all(line.startswith(b"data: {") for line in events[::2]), events
    wait_until(lambda: all_kv_free(cluster), 10, "the decode pods to free a disconnected request")
    assert cancelled_streams(cluster) == before + 1, "counted as the client going away"


def test_a_finished_stream_is_counted_by_its_finish_reason_not_as_cancelled(cluster, api, model_id):
    before = cancelled_streams(cluster)
    for stream in (False, True):
        answer = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=3, stream=stream)
        if stream:
            list(answer)  # read to [DONE]
    assert cancelled_streams(cluster) == before


def test_health_is_ok_while_requests_can_be_routed(cluster, client):
    with urllib.request.urlopen(cluster.gateway_http_url.removesuffix("/v1") + "/health") as health:
        assert health.status == 200
    assert client.generate(GenerateRequest(text=PROMPT, sampling=SamplingParams(
        temperature=0, max_tokens=2))).last.finish_reason is FinishReason.LENGTH


def test_the_prefill_route_can_be_pinned_over_http_and_is_named_with_its_reason(api, model_id):
    for route in ("chain", "local"):
        answer = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0,
                                        extra_body={"prefill_route": route})
        taken = answer.model_extra["baton"]["route"]
        assert taken["path"] == route and taken["reason"].startswith(f"prefill_route {route}")
    with pytest.raises(openai.BadRequestError) as error:
        api.completions.create(model=model_id, prompt=PROMPT, max_tokens=4,
                               extra_body={"prefill_route": "nearest"})
    assert error.value.body["param"] == "prefill_route"


def test_usage_reports_the_prompt_tokens_a_decode_pod_had_cached(api, model_id):
    prompt = PROMPT * 12  # several full blocks
    answers = [api.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"prefill_route": "local"})
               for _ in range(3)]
    assert len({answer.choices[0].text for answer in answers}) == 1
    cached = [answer.usage.prompt_tokens_details.cached_tokens for answer in answers]
    assert cached[1] > 0 and cached[2] > 0, f"cache-aware routing sends a repeat to its pod: {cached}"
    assert all(c < answers[0].usage.prompt_tokens for c in cached), "the last token is computed"
