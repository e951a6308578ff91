"""Execution: one model forward over one iteration's ``[prefill chunks | decode tokens]``.

The linear layers run once over all the iteration's tokens (SARATHI's gain:
weights are read once for prefill and decodes together); attention runs per
prefill chunk (one ``Segment`` each, its slots claimed here: ``KVPool.prefill_segment``)
against its KV in the pool, and for the decodes as one ``DecodeBatch`` whose metadata the
runner builds here too (``KVPool.claim_decode``, ``decode_step``): the model reads and
writes the cache through them and never calls the pool. Decodes go shortest first, so that the batch's groups
of similar length are consecutive rows. Only the rows whose sequence samples
this step — decodes and final prefill chunks — are turned into logits. A decode-only
iteration is replayed from a CUDA graph where the runner has ``DecodeGraphs`` (a GPU) and
the step fits one. The logits stay where the model made them (``StepLogits``): on a GPU only
what sampling reads of them crosses to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.host_to_device import to_device
from baton.kv.pool import KVPool
from baton.model.forward_batch import DecodeBatch, Segment
from baton.model.llama import CausalLM
from baton.sarathi.decode_graphs import DecodeGraphs
from baton.sarathi.request import Sequence
from baton.sarathi.scheduler import SchedulerOutput
from baton.transfer.device_copy import to_host


class StepLogits:
    """One step's logits [rows, vocab] fp32, where the model made them, and what sampling
    reads of them (``pick``).

    Why: on a GPU the whole block would cross PCIe every step (at batch 64 with a 128k
    vocabulary, 33 MB: over a millisecond, about as long as a 1B model's whole decode step)
    while a greedy row needs only its argmax. So the argmax of every row is taken on the
    device, and only it (8 bytes a row) and the rows a sampler draws from cross, in one pinned
    copy. On a CPU nothing moves: numpy's argmax (several times faster than torch's CPU
    argmax over a step's logits) and views of the drawn rows only (a view per row of the
    step costs more than the rows a sampler reads). numpy and torch both take the first
    maximum."""

    def __init__(self, logits: torch.Tensor, prompt_rows: list[PromptRows] | None = None) -> None:
        self.logits = logits
        self.prompt_rows = prompt_rows or []  # after the sampling rows: prompt log probabilities

    def pick(self, drawn: list[int]) -> tuple[list[int], dict[int, torch.Tensor]]:
        """(the greedy token of every row, {row: its logits on the host} for the rows in
        ``drawn``, those a sampler draws from)."""
        logits = self.logits
        if not logits.is_cuda:
            return logits.numpy().argmax(axis=1).tolist(), {row: logits[row] for row in drawn}
        tensors = [logits.argmax(dim=1)]
        if drawn:
            tensors.append(logits.index_select(0, torch.tensor(drawn, device=logits.device)))
        host = to_host(tensors).wait()
        return host[0].tolist(), dict(zip(drawn, host[1])) if drawn else {}


@dataclass(frozen=True)
class PromptRows:
    """The logits rows of one prefill chunk whose request reports its prompt's log
    probabilities: ``count`` rows from ``first_row``, for positions ``start`` onwards."""

    seq: Sequence
    first_row: int
    start: int
    count: int


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.pool = pool
        self.graphs = graphs

    def execute(self, plan: SchedulerOutput) -> tuple[list[Sequence], StepLogits]:
        """Run the plan; returns (sequences that sample, their logits, a row each)."""
        token_ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        output_rows: list[int] = []
        sampling: list[Sequence] = []
        prompt_chunks: list[tuple[Sequence, int, int, int]] = []  # (seq, first token row, start, n)
        # Every segment carries its sequence's compressor as attention observer (prompt
        # chunks score the prompt; decode steps feed the generation-phase update).
        for chunk in plan.prefills:
            seq, start = chunk.seq, chunk.seq.num_computed
            if seq.collects_prompt_logprobs:
                prompt_chunks.append((seq, len(token_ids), start, chunk.num_tokens))
            token_ids += seq.token_ids[start:start + chunk.num_tokens]
            positions += range(start, start + chunk.num_tokens)
            kv = self.pool.prefill_segment(seq.request_id, chunk.num_tokens)
            segments.append(Segment(chunk.num_tokens, kv, seq.compressor))
            if chunk.completes:
                output_rows.append(len(token_ids) - 1)
                sampling.append(seq)
        decode = None
        if plan.decodes:
            decodes = sorted(plan.decodes, key=lambda seq: seq.num_computed)
            output_rows += range(len(token_ids), len(token_ids) + len(decodes))
            decode_ids = [seq.token_at(seq.num_computed) for seq in decodes]
            decode_positions = [seq.num_computed for seq in decodes]
            observers = [seq.compressor for seq in decodes]
            claimed = self.pool.claim_decode([seq.request_id for seq in decodes])
            if not segments and self.graphs is not None:
                logits = self.graphs.run(claimed, decode_ids, decode_positions, observers)
                if logits is not None:
                    return decodes, StepLogits(logits)
            token_ids += decode_ids
            positions += decode_positions
            sampling += decodes
            in_place = self.model.reads_decode_cache_in_place(self.pool.k_cache.dtype)
            decode = DecodeBatch(self.pool.decode_step(claimed, grouped=not in_place), observers)
        prompt_rows = []
        for seq, first_token_row, start, count in prompt_chunks:  # after the sampling rows
            prompt_rows.append(PromptRows(seq, len(output_rows), start, count))
            output_rows += range(first_token_row, first_token_row + count)
        device = self.model.device
        hidden = self.model(to_device(token_ids, device), to_device(positions, device), segments,
                            to_device(output_rows, device), decode)
        return sampling, StepLogits(self.model.logits(hidden), prompt_rows)
