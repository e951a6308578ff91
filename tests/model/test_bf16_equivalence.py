"""bfloat16 on the CPU (the dtype ``auto`` picks on CPUs with fast bf16): as close to the
fp32 truth as transformers' own bf16 forward on the same CPU.

The two runtimes do the same arithmetic in bf16 in different kernels and summation
orders, so each lands at its own rounding distance from the fp32 result: there is no
common exact answer. The bar is the GPU tests' (``tests/gpu/test_cuda.py``): our distance
from transformers' fp32 logits may be at most twice transformers' bf16 distance, or
``FLOOR_ULPS`` units of bf16 rounding at the largest logit when transformers lands very
close. A real defect (a swapped weight, RoPE at the wrong position, a mask off by one)
moves logits by O(1), two orders of magnitude above either distance. The scenario covers
a whole prefill, two-slice prefills over a paged pool and batched decode steps.
"""

from __future__ import annotations

import pytest
import torch
from baton.model import load_checkpoint
from hf_reference import (
    EQUIVALENCE_CASES,
    REDUCED_PRECISION_CASES,
    case_id,
    max_error,
    reference_logits,
    run_scenario,
    save_case,
    sequences,
)

SLACK = 2.0
FLOOR_ULPS = 4


@pytest.mark.parametrize("case", REDUCED_PRECISION_CASES, ids=case_id)
def test_bf16_on_cpu_is_as_close_to_fp32_as_transformers_bf16(case, tmp_path):
    import transformers

    hf_model = save_case(case, tmp_path, seed=EQUIVALENCE_CASES.index(case))
    ids = sequences(hf_model.config.vocab_size)
    truth = reference_logits(hf_model, ids)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    theirs = max_error(reference_logits(theirs_model, ids), truth)
    ours = max_error(run_scenario(load_checkpoint(tmp_path, dtype="bfloat16", device="cpu",
                                                  with_tokenizer=False), ids), truth)
    scale = max(float(t.abs().max()) for t in truth)
    bar = max(SLACK * theirs, FLOOR_ULPS * torch.finfo(torch.bfloat16).eps * scale)
    print(f"CPU-BF16-EQUIVALENCE {case_id(case)} ours={ours:.2e} transformers={theirs:.2e} "
          f"bar={bar:.2e} largest-logit={scale:.2f}")
    assert ours <= bar
