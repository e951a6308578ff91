"""SARATHI's rule for the token budget, measured: the largest budget whose iteration still
meets the time-between-tokens target on this device, model and dtype.

Every running decode waits for the whole iteration, so the iteration's time is
the time between its decodes' tokens; a larger budget prefills more prompt per
iteration (better throughput, earlier first tokens for queued prompts) until an
iteration outlasts the target. The best budget differs by orders of magnitude
between a small model on a CPU and a large one on a GPU, so it is timed at start:
one forward per candidate budget, shaped like a prefill iteration (prompt chunks
of up to 512 tokens), largest candidate first under the target wins.
"""

from __future__ import annotations

import torch

from baton.kv.dense import DenseKV
from baton.model.forward_batch import Segment
from baton.model.llama import CausalLM
from baton.model.probe import fastest_run_s

CANDIDATES = (256, 512, 1024, 2048, 4096, 8192)
CHUNK_TOKENS = 512  # prompt chunks of this length fill a measured iteration

_measured: dict[tuple, int] = {}


def measure_token_budget(model: CausalLM, target_iteration_ms: float) -> int:
    """The largest of ``CANDIDATES`` whose forward takes at most ``target_iteration_ms``
    (the smallest candidate when none does). Measured once per model shape, dtype,
    device and target in a process."""
    key = (repr(model.config), model.dtype, str(model.device), target_iteration_ms)
    if key not in _measured:
        _measured[key] = _measure(model, target_iteration_ms / 1000.0)
    return _measured[key]


def _measure(model: CausalLM, target_s: float) -> int:
    chosen = CANDIDATES[0]
    for budget in CANDIDATES:
        if iteration_s(model, budget) > target_s:
            break
        chosen = budget
    return chosen


def iteration_s(model: CausalLM, num_tokens: int) -> float:
    """The faster of two forwards of ``num_tokens`` prompt tokens in chunks (the first also
    builds the shape's kernels: oneDNN primitives, packed weights)."""
    chunk = min(CHUNK_TOKENS, model.config.max_position_embeddings)
    lengths = [chunk] * (num_tokens // chunk) + ([num_tokens % chunk] if num_tokens % chunk else [])
    device = model.device
    token_ids = torch.randint(0, model.config.vocab_size, (num_tokens,), device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    layers = model.config.num_hidden_layers
    rows = torch.tensor([num_tokens - 1], device=device)
    return fastest_run_s(
        lambda: model(token_ids, positions, [Segment(n, DenseKV(layers)) for n in lengths], rows),
        runs=2, warmup=0, device=device)
