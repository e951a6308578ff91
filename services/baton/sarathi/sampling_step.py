"""What a step's logits give its sequences: each sampling sequence's token (and its log
probabilities), and the prompt log probabilities of the chunks that report them.

A greedy request with nothing else to do takes the step's argmax (``StepLogits.pick``, no
row copied); every other row goes through one batched ``draw`` (``baton.sampling.sampler``).
"""

from __future__ import annotations

import torch

from baton.sampling.logprobs import logprobs_of
from baton.sampling.sampler import Draw, draw
from baton.sarathi.request import Sequence
from baton.sarathi.runner import StepLogits


def draw_tokens(sampling: list[Sequence], logits: StepLogits) -> list[Draw]:
    """The next token of each of ``sampling`` (row i of the logits is sampling[i]'s)."""
    drawn_rows = [index for index, seq in enumerate(sampling)
                  if not seq.params.fast_path and seq.samples_next]  # a replayed row draws nothing
    greedy, drawn = logits.pick(drawn_rows)
    picks = [Draw(token) for token in greedy]
    if drawn_rows:
        draws = draw(torch.stack([drawn[index] for index in drawn_rows]),
                     [sampling[index].sampler for index in drawn_rows],
                     [sampling[index].num_generated for index in drawn_rows])
        for index, picked in zip(drawn_rows, draws):
            picks[index] = picked
    return picks


def score_prompts(logits: StepLogits) -> None:
    """The prompt log probabilities of this step's chunks that report them, onto their
    sequences: the row at position p scores prompt token p + 1 (the last prompt row's is the
    first sample's, not a prompt token's)."""
    for rows in logits.prompt_rows:
        seq = rows.seq
        if rows.start == 0:  # (again, after a preemption)
            seq.prompt_logprobs = []
        count = min(rows.count, len(seq.prompt_ids) - 1 - rows.start)
        targets = seq.prompt_ids[rows.start + 1:rows.start + 1 + count]
        block = logits.logits[rows.first_row:rows.first_row + count].to("cpu")
        seq.prompt_logprobs += logprobs_of(block, targets, [seq.params.prompt_logprobs] * count)
