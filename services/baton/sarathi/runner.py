"""Execution: one model forward over one iteration's ``[prefill chunks | decode tokens]``.

The linear layers run once over all the iteration's tokens (SARATHI's gain:
weights are read once for prefill and decodes together); attention runs per
prefill chunk (one ``Segment`` each) against its KV in the pool, and for the
decodes as one ``DecodeBatch`` whose metadata the runner builds here
(``KVPool.begin_decode``): the model reads and writes the cache through it and
never manages the pool. Decodes go shortest first, so that the batch's groups
of similar length are consecutive rows. Only the rows whose sequence samples
this step — decodes and final prefill chunks — are turned into logits.
"""

from __future__ import annotations

import torch

from baton.host_to_device import to_device
from baton.kv.pool import KVPool
from baton.model.llama import CausalLM, DecodeBatch, Segment
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
        for chunk in plan.prefills:
            seq, start = chunk.seq, chunk.seq.num_computed
            token_ids += seq.token_ids[start:start + chunk.num_tokens]
            positions += range(start, start + chunk.num_tokens)
            segments.append(Segment(chunk.num_tokens, self.pool.view(seq.request_id), seq.compressor))
            if chunk.completes:
                output_rows.append(len(token_ids) - 1)
                sampling.append(seq)
        decode = None
        if plan.decodes:
            decodes = sorted(plan.decodes, key=lambda seq: seq.num_computed)
            output_rows += range(len(token_ids), len(token_ids) + len(decodes))
            token_ids += [seq.token_at(seq.num_computed) for seq in decodes]
            positions += [seq.num_computed for seq in decodes]
            sampling += decodes
            observers = [seq.compressor for seq in decodes]
            in_place = self.model.reads_decode_cache_in_place()
            step = self.pool.begin_decode([seq.request_id for seq in decodes], grouped=not in_place)
            decode = DecodeBatch(step, observers)
        device = self.model.device
        hidden = self.model(to_device(token_ids, device), to_device(positions, device), segments,
                            to_device(output_rows, device), decode)
        return sampling, self.model.logits(hidden).cpu()
