"""The engine's API: bad input is a ValueError naming the value, a thread-safe inbox,
finish reasons, and KV-capacity limits that finish a request instead of crashing."""

from __future__ import annotations

import threading

import pytest
from baton.sampling.params import SamplingParams
from engine_fixtures import make_engine, prompts_of_lengths


@pytest.mark.parametrize("prompt, message", [
    ([], "the prompt is empty"),
    ([1, 300, 2], r"prompt token ids \[300\] are outside the vocabulary"),
    ([-1], r"prompt token ids \[-1\] are outside the vocabulary"),
    ("hello", "a text prompt needs a tokenizer"),
    ([1] * 1024, "prompt of 1024 tokens \\+ max_tokens 64 = 1088 exceeds the model's limit"),
])
def test_bad_prompts_are_rejected_with_the_value(model, prompt, message):
    engine = make_engine(model)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt)
    assert not engine.has_unfinished()


def test_duplicate_request_ids_and_bad_prefilled_kv_are_rejected(model):
    engine = make_engine(model)
    engine.add_request([1, 2, 3], request_id="a")
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request([4], request_id="a")
    with pytest.raises(ValueError, match="prefilled KV has 1 layers, the model 3"):
        engine.add_prefilled_request([1, 2], [None], first_token=3)
    with pytest.raises(ValueError, match="first_token 999"):
        engine.add_prefilled_request([1, 2], [None] * 3, first_token=999)


def test_a_prompt_longer_than_the_pool_is_rejected_up_front(model):
    engine = make_engine(model, num_blocks=30)  # 10 blocks of 4 tokens per layer
    with pytest.raises(ValueError, match="prompt has 45 tokens; the KV pool holds 40 tokens"):
        engine.add_request([1] * 45)


def test_a_lone_sequence_that_outgrows_the_pool_finishes_with_length(model):
    engine = make_engine(model, num_blocks=30)
    (result,) = engine.generate([[5] * 30], SamplingParams(temperature=0.0, max_tokens=100))
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 40 - 30 + 1  # the pool's 40 slots, plus the last sample
    assert engine.pool.num_free_blocks == 30


def test_stop_token_and_max_tokens_finish_reasons(model):
    engine = make_engine(model)
    (free_run,) = engine.generate([[9, 8, 7]], SamplingParams(temperature=0.0, max_tokens=6))
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 6
    stop_at = free_run.token_ids[2]
    (stopped,) = engine.generate([[9, 8, 7]], SamplingParams(temperature=0.0, max_tokens=6,
                                                            stop_token_ids=[stop_at]))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run.token_ids[:free_run.token_ids.index(stop_at) + 1]


def test_requests_from_other_threads_join_a_running_loop(model):
    engine = make_engine(model)
    prompts = prompts_of_lengths(6, 11, 17, 25)
    params = SamplingParams(temperature=0.0, max_tokens=5)
    expected = [r.token_ids for r in make_engine(model).generate(prompts, params)]
    tokens: dict[str, list[int]] = {}
    finished = threading.Event()
    ids: list[str] = []

    def loop() -> None:
        while not finished.is_set():
            if not engine.has_unfinished():
                engine.wait_for_work(0.05)
                continue
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if len(ids) == len(prompts) and not engine.has_unfinished():
                finished.set()

    thread = threading.Thread(target=loop)
    thread.start()
    submitters = [threading.Thread(target=lambda p=p, i=i: ids.append(engine.add_request(p, params, str(i))))
                  for i, p in enumerate(prompts)]
    for submitter in submitters:
        submitter.start()
    for submitter in submitters:
        submitter.join()
    all_done = finished.wait(60)
    finished.set()
    thread.join()
    assert all_done
    assert [tokens[str(i)] for i in range(len(prompts))] == expected
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=12),
                                    SamplingParams(temperature=0.9, seed=3, max_tokens=12)],
                         ids=["greedy", "seeded"])
def test_a_stream_resumed_from_its_tokens_continues_it(model, params):
    # What a decode pod does for a stream that moved to it: the prompt plus the tokens sent
    # so far, told how many were generated, continues exactly where the first pod stopped.
    (prompt,) = prompts_of_lengths(23)
    whole = make_engine(model).generate([prompt], params)[0].token_ids
    engine = make_engine(model)
    rest_params = SamplingParams(temperature=params.temperature, seed=params.seed, max_tokens=7)
    request_id = engine.add_request(prompt + whole[:5], rest_params, generated_before=5)
    rest = []
    while engine.has_unfinished():
        for output in engine.step():
            assert output.request_id == request_id
            rest += output.new_token_ids
    assert whole[:5] + rest == whole
