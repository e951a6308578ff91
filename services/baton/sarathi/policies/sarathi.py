"""SARATHI: decode-maximal batches with chunked prefill.

Every iteration has a token budget C. All B-1 running decodes get their one
token first (decodes are never starved by a long prompt); the remaining
C-(B-1) tokens go to one chunk of one prompt — the partially prefilled one
if there is one, else the oldest waiting prompt that the pool can hold. With
a tile size the budget is first rounded down to a multiple of the tile, so
that chunk + decodes fills whole tiles of the matmuls.
"""

from __future__ import annotations

from baton.sarathi.scheduler import PrefillChunk, Scheduler, SchedulerOutput, register_policy


@register_policy("sarathi")
class SarathiScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        self.admit_arrived()
        self.grant_decodes(output)
        room = self.tiled_budget() - len(output.decodes)
        if room <= 0:
            return output
        seq = self.prefilling[0] if self.prefilling else self.admit_next(output)
        if seq is not None:
            output.prefills.append(PrefillChunk(seq, min(seq.num_uncomputed, room)))
        return output

    def tiled_budget(self) -> int:
        tile = self.config.tile_size
        budget = self.config.token_budget
        return budget - budget % tile if tile else budget
