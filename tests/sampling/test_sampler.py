"""The sampler: validation naming the value, greedy, temperature/top-k/top-p, seeds, stop strings."""

from __future__ import annotations

import pytest
import torch
from baton.sampling.params import SamplingParams
from baton.sampling.sampler import Sampler
from baton.sampling.stops import StopStringMatcher


@pytest.mark.parametrize("fields, message", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0, got -0.5"),
    ({"temperature": float("nan")}, "got nan"),
    ({"top_k": -1}, r"top_k must be >= 0 \(0 = off\), got -1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, "got 1.5"),
    ({"seed": -3}, "seed must be in .*got -3"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"stop_token_ids": [2, -7]}, r"stop_token_ids must be >= 0, got \[-7\]"),
    ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
])
def test_bad_params_name_the_value(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def random_logits(seed: int = 0, vocab: int = 100) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_draws_nothing():
    logits = random_logits()
    sampler = Sampler(SamplingParams(temperature=0.0))
    assert sampler.sample(logits, 0) == int(logits.argmax())


def test_a_seed_reproduces_the_stream_whatever_else_is_sampled():
    params = SamplingParams(temperature=1.0, seed=42)
    first, second, other = Sampler(params), Sampler(params), Sampler(SamplingParams(seed=43))
    stream_a, stream_b = [], []
    for step in range(50):
        logits = random_logits(step)
        stream_a.append(first.sample(logits, step))
        other.sample(logits, step)  # another request sampling in between changes nothing
        stream_b.append(second.sample(logits, step))
    assert stream_a == stream_b
    assert len(set(stream_a)) > 5, "temperature 1 over spread logits samples more than one token"


def test_a_sampler_that_starts_mid_stream_continues_it():
    # A stream that moved to another pod after 20 tokens: a fresh sampler there, asked for
    # positions 20 onwards, draws what the first would have drawn.
    params = SamplingParams(temperature=1.0, seed=7)
    whole, moved = Sampler(params), Sampler(params)
    logits = [random_logits(step) for step in range(40)]
    expected = [whole.sample(row, step) for step, row in enumerate(logits)]
    assert [moved.sample(logits[step], step) for step in range(20, 40)] == expected[20:]


def test_top_k_keeps_only_the_k_best():
    logits = random_logits()
    probs = Sampler(SamplingParams(top_k=5, seed=0)).probabilities(logits)
    assert set(torch.nonzero(probs).flatten().tolist()) == set(torch.topk(logits, 5).indices.tolist())
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_covering_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = Sampler(SamplingParams(top_p=0.7, seed=0)).probabilities(logits)
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    only_best = Sampler(SamplingParams(top_p=0.1, seed=0)).probabilities(logits)
    assert only_best.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_temperature_sharpens_and_flattens():
    logits = random_logits()
    cold = Sampler(SamplingParams(temperature=0.1, seed=0)).probabilities(logits)
    hot = Sampler(SamplingParams(temperature=10.0, seed=0)).probabilities(logits)
    assert cold.max() > 0.9 and hot.max() < 0.1


def test_sampling_matches_the_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    sampler = Sampler(SamplingParams(seed=5))
    counts = torch.bincount(torch.tensor([sampler.sample(logits, i) for i in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000.0, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)


def test_stop_string_split_over_deltas_is_found_and_never_emitted():
    matcher = StopStringMatcher(["\n\n", "END"])
    emitted = []
    for delta in ["def f():", "\n", "    return 1", "\n", "\nmore"]:
        text, stopped = matcher.push(delta)
        emitted.append(text)
        if stopped:
            break
    assert "".join(emitted) == "def f():\n    return 1"
    assert stopped


def test_text_that_only_starts_like_a_stop_string_is_released():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("a ST") == ("a ", False)
    assert matcher.push("ART") == ("START", False)
    assert matcher.push("x S") == ("x ", False)
    assert matcher.flush() == "S"


# --- the batched draw: processors, log probabilities, rows alike alone or together --------

from baton.sampling.sampler import draw


def dense_penalties(logits: torch.Tensor, prompt: list[int], generated: list[int],
                    repetition: float, frequency: float, presence: float) -> torch.Tensor:
    """vLLM's definition, over the whole vocabulary."""
    scores = logits.clone()
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=len(scores)).float()
    seen = counts > 0
    seen[torch.tensor(prompt)] = True
    scores = torch.where(seen, torch.where(scores > 0, scores / repetition, scores * repetition), scores)
    return scores - frequency * counts - presence * (counts > 0)


def test_penalties_equal_their_dense_definition_on_the_tokens_seen():
    logits = random_logits(1, vocab=200)
    prompt, generated = [3, 5, 5, 9], [5, 7, 7, 7, 11]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=0.2, logprobs=3)
    sampler = Sampler(params, prompt, generated=generated)
    expected = dense_penalties(logits, prompt, generated, 1.3, 0.4, 0.2)
    picked = draw(logits[None, :], [sampler], [len(generated)])[0]
    assert picked.token_id == int(expected.argmax())
    assert picked.logprobs.logprob == pytest.approx(
        torch.log_softmax(expected, -1)[picked.token_id].item(), abs=1e-5)
    sampler.accept(picked.token_id)  # the counts follow the accepted tokens
    again = dense_penalties(logits, prompt, [*generated, picked.token_id], 1.3, 0.4, 0.2)
    assert draw(logits[None, :], [sampler], [6])[0].token_id == int(again.argmax())


def test_bias_allowed_bad_words_and_min_tokens_shape_the_choice():
    logits = random_logits(2, vocab=50)
    best = int(logits.argmax())
    biased = Sampler(SamplingParams(temperature=0.0, logit_bias={7: 100.0}))
    assert draw(logits[None, :], [biased], [0])[0].token_id == 7
    allowed = Sampler(SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]))
    assert draw(logits[None, :], [allowed], [0])[0].token_id == (1 if logits[1] > logits[2] else 2)
    banned = Sampler(SamplingParams(temperature=0.0, bad_words_ids=[[4, best]]), generated=[4])
    assert draw(logits[None, :], [banned], [1])[0].token_id != best
    not_after_other = Sampler(SamplingParams(temperature=0.0, bad_words_ids=[[4, best]]), generated=[3])
    assert draw(logits[None, :], [not_after_other], [1])[0].token_id == best
    held = Sampler(SamplingParams(temperature=0.0, min_tokens=2), stop_ids=[best])
    assert draw(logits[None, :], [held], [1])[0].token_id != best
    assert draw(logits[None, :], [held], [2])[0].token_id == best


def test_min_p_drops_the_unlikely():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = Sampler(SamplingParams(min_p=0.2, seed=0)).probabilities(logits)  # below 0.1: out
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_rows_draw_alike_alone_and_in_a_batch():
    logits = torch.stack([random_logits(seed, vocab=300) for seed in range(6)])
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(seed=1, top_k=20),
              SamplingParams(seed=2, top_p=0.8, min_p=0.05, logprobs=0),
              SamplingParams(seed=3, repetition_penalty=1.5), SamplingParams(seed=4),
              SamplingParams(temperature=0.0, logit_bias={5: 3.0})]
    together = draw(logits, [Sampler(p, [1, 2, 3]) for p in params], [4] * 6)
    alone = [draw(logits[row][None, :], [Sampler(p, [1, 2, 3])], [4])[0]
             for row, p in enumerate(params)]
    assert together == alone
    reported = together[0].logprobs
    expected = torch.log_softmax(logits[0], -1)
    assert reported.rank == 1 and reported.logprob == pytest.approx(expected.max().item(), abs=1e-6)
    assert [token for token, _ in reported.top] == torch.topk(expected, 2).indices.tolist()
