"""Execution: one model forward over one iteration's ``[prefill chunks | decode tokens]``.

The linear layers run once over all the iteration's tokens (SARATHI's gain:
weights are read once for prefill and decodes together); attention runs per
sequence (one ``Segment`` each) against its KV in the pool. Only the rows
whose sequence samples this step — decodes and final prefill chunks — are
turned into logits.
"""

from __future__ import annotations

import torch

from baton.host_to_device import to_device
from baton.kv.pool import KVPool
from baton.model.llama import CausalLM, Segment
from baton.sarathi.request import Sequence
from baton.sarathi.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool) -> None:
        self.model = model
        self.pool = pool

    def execute(self, plan: SchedulerOutput) -> tuple[list[Sequence], torch.Tensor]:
        """Run the plan; returns (sequences that sample, their logits [R, vocab] fp32 on the host:
        one copy per step, after which the samplers read rows without a device sync each)."""
        token_ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        output_rows: list[int] = []
        sampling: list[Sequence] = []
        # Every segment carries its sequence's compressor as attention observer (prompt
        # chunks score the prompt; decode steps feed the generation-phase update).
        work = [(chunk.seq, chunk.num_tokens, chunk.completes, chunk.seq.compressor)
                for chunk in plan.prefills]
        work += [(seq, 1, True, seq.compressor) for seq in plan.decodes]
        for seq, num_tokens, samples, observer in work:
            start = seq.num_computed
            token_ids += seq.token_ids[start:start + num_tokens]
            positions += range(start, start + num_tokens)
            segments.append(Segment(num_tokens, self.pool.view(seq.request_id), observer))
            if samples:
                output_rows.append(len(token_ids) - 1)
                sampling.append(seq)
        device = self.model.device
        hidden = self.model(to_device(token_ids, device), to_device(positions, device), segments,
                            to_device(output_rows, device))
        return sampling, self.model.logits(hidden).cpu()
