"""SARATHI: decode-maximal batches with chunked prefill.

Every iteration has a token budget C. All B-1 running decodes get their one
token first (decodes are never starved by a long prompt); the remaining
C-(B-1) tokens go to one chunk of a prompt — the partially prefilled one if
there is one, else the oldest waiting prompt that the pool can hold (and, if
that prompt ends before the budget does, the next one). With
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
        # The partially prefilled prompt first; when a prompt ends inside the budget, the rest
        # goes to the next prompt (Sarathi-Serve), so short prompts still fill the iteration.
        queued = list(self.prefilling)
        while room > 0:
            seq = queued.pop(0) if queued else self.admit_next(output)
            if seq is None:
                break
            chunk = PrefillChunk(seq, min(seq.num_to_prefill, room))
            output.prefills.append(chunk)
            room -= chunk.num_tokens
        return output

    def tiled_budget(self) -> int:
        tile = self.config.tile_size
        budget = self.config.token_budget
        return budget - budget % tile if tile else budget
