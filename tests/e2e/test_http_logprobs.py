"""Log probabilities and sampling controls through the OpenAI door of the local cluster, with
the real `openai` client: generated tokens' log probabilities equal `transformers`'
log_softmax on the shipped model (fp32, within 1e-4) on the local route and the chain (whose
tail draws the first token), an echoed prompt's too (lm-eval's max_tokens 0), n choices each
their own reproducible seed stream, and penalties and biases applied alike on both routes."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.sampling.params import SamplingParams
from e2e_cluster import CHAIN_THRESHOLD_TOKENS, long_prompt_ids

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4
PROMPT = "import os\n\ndef main():\n"



@pytest.fixture(scope="module")
def theirs():
    return transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL_DIR,
                                                             dtype=torch.float32).eval()


def their_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: row p is the distribution of token p + 1 after tokens 0..p."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def prompt_for(reference, route: str) -> list[int]:
    if route == "chain":
        return long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 40)
    return reference.tokenizer.encode(PROMPT)


@pytest.mark.parametrize("route", ["local", "chain"])
def test_generated_logprobs_equal_transformers_log_softmax(api, model_id, reference, theirs, route):
    prompt_ids = prompt_for(reference, route)
    answer = api.completions.create(
        model=model_id, prompt=prompt_ids, max_tokens=10, temperature=0, logprobs=5,
        extra_body={"return_token_ids": True, "prefill_route": route,
                    "compression": {"enabled": False}})
    (choice,) = answer.choices
    assert answer.model_extra["baton"]["route"]["path"] == route
    generated = choice.model_extra["token_ids"]
    expected = their_logprobs(theirs, prompt_ids + generated)[len(prompt_ids) - 1:]
    logprobs = choice.logprobs
    assert len(logprobs.token_logprobs) == len(generated) == 10
    assert [reference.tokenizer.decode([t]) for t in generated] == logprobs.tokens
    for position, token in enumerate(generated):
        assert abs(logprobs.token_logprobs[position] - expected[position, token].item()) < TOLERANCE
        top_values = torch.topk(expected[position], 5).values.tolist()
        ours = sorted(logprobs.top_logprobs[position].values(), reverse=True)[:5]
        assert ours == pytest.approx(top_values, abs=TOLERANCE)
        # greedy: the token drawn is the most likely one
        assert logprobs.token_logprobs[position] == pytest.approx(top_values[0], abs=TOLERANCE)


def test_an_echoed_prompt_has_its_logprobs_as_lm_eval_asks_them(api, model_id, reference, theirs):
    prompt_ids = reference.tokenizer.encode(PROMPT + "    print(os.getcwd())\n")
    answer = api.completions.create(model=model_id, prompt=prompt_ids, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    (choice,) = answer.choices
    expected = their_logprobs(theirs, prompt_ids)
    logprobs = choice.logprobs
    assert choice.text == reference.tokenizer.decode(prompt_ids) and choice.finish_reason == "length"
    assert len(logprobs.tokens) == len(prompt_ids) and logprobs.token_logprobs[0] is None
    for position, token in enumerate(prompt_ids[1:]):
        assert abs(logprobs.token_logprobs[position + 1] - expected[position, token].item()) < TOLERANCE
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    with pytest.raises(openai.BadRequestError, match="local route"):
        api.completions.create(model=model_id, prompt=prompt_ids, max_tokens=1, echo=True,
                               logprobs=1, extra_body={"prefill_route": "chain"})


def test_chat_logprobs_streamed_equal_whole(api, model_id):
    request = {"model": model_id, "messages": [{"role": "user", "content": "def add(a, b):"}],
               "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    whole = api.chat.completions.create(**request).choices[0]
    content = whole.logprobs.content
    assert len(content) == 8 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=TOLERANCE)
               for entry in content)
    assert "".join(entry.token for entry in content) == whole.message.content
    streamed = [entry for chunk in api.chat.completions.create(**request, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content]


def test_n_choices_are_each_their_own_seed_stream(api, model_id):
    request = {"model": model_id, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0,
               "seed": 1234}
    answer = api.completions.create(**request, n=3)
    texts = [choice.text for choice in sorted(answer.choices, key=lambda c: c.index)]
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    assert len(set(texts)) > 1, "three seeds sample three texts"
    # choice j is the request alone with seed + j, and a second run is the same
    assert texts[1] == api.completions.create(**{**request, "seed": 1235}).choices[0].text
    assert texts == [c.text for c in api.completions.create(**request, n=3).choices]
    assert answer.usage.completion_tokens == 36
    streamed = {}
    for chunk in api.completions.create(**request, n=3, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == texts
    best = api.completions.create(**request, n=1, best_of=3, logprobs=0)
    assert len(best.choices) == 1 and best.choices[0].text in texts


@pytest.mark.parametrize("route", ["local", "chain"])
def test_penalties_and_biases_are_applied_alike_on_both_routes(api, model_id, reference, route):
    prompt_ids = prompt_for(reference, route)
    controls = {"repetition_penalty": 1.4, "frequency_penalty": 0.7, "presence_penalty": 0.3,
                "logit_bias": {str(reference.tokenizer.encode(" ")[0]): -5.0}}
    answer = api.completions.create(
        model=model_id, prompt=prompt_ids, max_tokens=16, temperature=0,
        extra_body={**controls, "return_token_ids": True, "prefill_route": route,
                    "compression": {"enabled": False}})
    ours = answer.choices[0].model_extra["token_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.4,
                            frequency_penalty=0.7, presence_penalty=0.3,
                            logit_bias={int(k): v for k, v in controls["logit_bias"].items()})
    expected = reference.engine.generate([prompt_ids], params)[0].token_ids
    assert ours == expected
    assert ours != reference.tokens(prompt_ids, 16), "the controls change the greedy text"
