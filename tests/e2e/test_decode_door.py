"""One decode pod's own OpenAI door (what an InferencePool sends requests to), driven by the
real `openai` client beside the gateway's: a short prompt is prefilled on the pod, a long
one goes through the chain (the gateway's threshold, decided by the gateway's policy) and
its KV is pushed back to that pod, and the tokens equal the gateway's (greedy), whole and
streamed, completion and chat."""

from __future__ import annotations

import openai
import pytest
from e2e_cluster import CHAIN_THRESHOLD_TOKENS, long_prompt_ids

pytestmark = pytest.mark.slow
PROMPT = "import os\n\ndef main():\n"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pod_api(cluster):
    """The `openai` client of the first live decode pod's own door (an earlier test may have
    stopped one of the session's pods)."""
    pod = next(child for child in cluster.decode_pods() if child.process.poll() is None)
    client = openai.OpenAI(base_url=cluster.decode_http_url(pod),
                           api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()


def greedy(api, model_id: str, prompt_ids: list[int], salt: str, **extra):
    # a salt of its own per request: no prefix-cache hit turns a chain prompt local
    return api.completions.create(model=model_id, prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                  temperature=0, **extra,
                                  extra_body={"return_token_ids": True, "cache_salt": salt})


@pytest.mark.parametrize("path", ["local", "chain"])
def test_the_pods_door_routes_as_the_gateway_and_answers_its_tokens(api, pod_api, reference,
                                                                    model_id, path):
    prompt_ids = (long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 40)
                  if path == "chain" else reference.tokenizer.encode(PROMPT))
    through_gateway = greedy(api, model_id, prompt_ids, f"gateway-{path}")
    at_the_pod = greedy(pod_api, model_id, prompt_ids, f"pod-{path}")
    route = at_the_pod.model_extra["baton"]["route"]
    assert route["path"] == through_gateway.model_extra["baton"]["route"]["path"] == path
    assert route["reason"].startswith(f"prompt of {len(prompt_ids)} tokens")
    assert at_the_pod.choices[0].model_extra["token_ids"] == \
        through_gateway.choices[0].model_extra["token_ids"]
    assert at_the_pod.choices[0].text == through_gateway.choices[0].text
    assert at_the_pod.usage.prompt_tokens == len(prompt_ids)

    streamed = []
    for chunk in greedy(pod_api, model_id, prompt_ids, f"pod-stream-{path}", stream=True):
        for choice in chunk.choices:
            streamed += choice.model_extra.get("token_ids") or []
    assert streamed == through_gateway.choices[0].model_extra["token_ids"]


def test_a_chat_at_the_pods_door_is_the_gateways(api, pod_api, model_id):
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    answers = [client.chat.completions.create(model=model_id, messages=messages, temperature=0,
                                              max_tokens=MAX_TOKENS)
               for client in (api, pod_api)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[1].model_extra["baton"]["route"]["path"] == "local"
