"""Separate phases (SARATHI's baseline): prefill-only and decode-only iterations.

Whenever a waiting prompt can be admitted, the iteration prefills whole
prompts only (as many as fit the token budget, at least one); otherwise it
decodes every running sequence. Decodes stall while prompts are prefilled —
the bubble that SARATHI's decode-maximal batches remove.
"""

from __future__ import annotations

from baton.sarathi.scheduler import Scheduler, SchedulerOutput, register_policy


@register_policy("separate")
class SeparatePhasesScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        self.admit_arrived()
        self.admit_whole_prompts(output)
        if not output.prefills:
            self.grant_decodes(output)
        return output
