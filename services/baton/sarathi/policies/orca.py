"""Orca-style iteration-level scheduling: whole prefills mixed into decode batches.

Every running sequence decodes one token; then whole waiting prompts join the
same iteration while the total stays within the token budget (one prompt
always may, however long). A long prompt therefore stretches that iteration,
and the time between tokens of every decode in it.
"""

from __future__ import annotations

from baton.sarathi.scheduler import Scheduler, SchedulerOutput, register_policy


@register_policy("orca")
class OrcaScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        self.admit_arrived()
        self.grant_decodes(output)
        self.admit_whole_prompts(output)
        return output
