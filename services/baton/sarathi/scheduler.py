"""The scheduling interface: queues, one iteration's plan, and the policy registry.

Design (after Sarathi-Serve's ``scheduler_registry``): a policy is a subclass
of ``Scheduler`` that implements ``schedule()``, registered under a name by
``@register_policy`` (``baton.registry``; the names are declared in
``baton.config.SCHEDULER_POLICIES``); a new policy is one new file in
``baton/sarathi/policies/`` and its name there. Policies decide *what* runs; ``KVManager`` decides
whether the pool can hold it; ``ModelRunner`` runs it. Between them travels a
``SchedulerOutput``: the prefill chunks (first in the flat batch) and the
decodes of one iteration.

Queues: ``waiting`` (priority, then arrival order; preempted sequences go back to its front),
``prefilling`` (admitted, prompt partly computed) and ``running`` (decoding).
"""

from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass, field

from baton.config import SCHEDULER_POLICIES, SchedulerConfig
from baton.sarathi.memory import KVManager, reset_for_recompute
from baton.sarathi.request import Sequence, Status


@dataclass
class PrefillChunk:
    seq: Sequence
    num_tokens: int  # feeds seq.token_ids[seq.num_computed : seq.num_computed + num_tokens]
    # The final chunk: the forward samples the sequence's next token (fixed when planned).
    completes: bool = field(init=False)

    def __post_init__(self) -> None:
        self.completes = self.seq.num_computed + self.num_tokens == self.seq.prefill_end


@dataclass
class SchedulerOutput:
    """One iteration's plan, in flat-batch order: ``[prefill chunks | decode tokens]``."""

    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # freed this step, recomputed later
    out_of_room: list[Sequence] = field(default_factory=list)  # cannot grow even alone: finish

    @property
    def num_prefill_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.prefills)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


POLICIES = SCHEDULER_POLICIES  # name -> Scheduler subclass
register_policy = POLICIES.register


def create_scheduler(config: SchedulerConfig, memory: KVManager) -> Scheduler:
    return POLICIES.get(config.policy)(config, memory)


class Scheduler(abc.ABC):
    def __init__(self, config: SchedulerConfig, memory: KVManager) -> None:
        self.config = config
        self.memory = memory
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []

    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Plan the next iteration (claims its KV; may preempt)."""

    # --- queues ----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Waiting in order of priority (a lower value first, vLLM's rule), then arrival."""
        priority = seq.params.priority
        index = len(self.waiting)
        while index and self.waiting[index - 1].params.priority > priority:
            index -= 1
        self.waiting.insert(index, seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of every queue and free its KV (finish or abort)."""
        for queue in (self.waiting, self.prefilling, self.running):
            if seq in queue:
                queue.remove(seq)
        self.memory.release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_active(self) -> int:
        return len(self.prefilling) + len(self.running)

    def update(self, output: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens are computed; final chunks start decoding."""
        for chunk in output.prefills:
            chunk.seq.num_computed += chunk.num_tokens
            self.memory.cache_computed(chunk.seq)  # while still prefilling: its KV is whole
            if chunk.completes:
                self.prefilling.remove(chunk.seq)
                chunk.seq.status = Status.RUNNING
                self.running.append(chunk.seq)
        for seq in output.decodes:
            seq.num_computed += 1
            self.memory.cache_computed(seq)

    # --- building blocks for policies ------------------------------------------------------

    def grant_decodes(self, output: SchedulerOutput) -> None:
        """Every running sequence decodes one token; the pool's shortfall preempts the newest."""
        grant = self.memory.reserve_decodes(self.running, self.prefilling + self.running)
        output.decodes = grant.decodes
        for seq in grant.preempted:
            self._drop_active(seq)
            reset_for_recompute(seq)
        # Back to the front of the queue, oldest first, ahead of newer arrivals.
        for seq in sorted(grant.preempted, key=lambda s: s.arrival, reverse=True):
            self.waiting.appendleft(seq)
        for seq in grant.out_of_room:
            self._drop_active(seq)
        output.preempted += grant.preempted
        output.out_of_room += grant.out_of_room

    def admit_arrived(self) -> None:
        """Sequences whose KV came from a prefill chain join the running set directly."""
        for seq in [s for s in self.waiting if s.arrived_kv is not None]:
            if self.num_active >= self.config.max_running or not self.memory.try_admit(seq):
                return
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)

    def admit_next(self, output: SchedulerOutput) -> Sequence | None:
        """Admit the oldest waiting prompt when the pool can hold all its uncomputed KV
        (plus one block per layer of headroom for each running sequence's next tokens)."""
        candidates = [s for s in self.waiting if s.arrived_kv is None]
        if not candidates or self.num_active >= self.config.max_running:
            return None
        seq = candidates[0]
        if seq.num_uncomputed > self.memory.capacity_tokens():
            # Can never fit (a pruned cache recomputed in full): finish it rather than wait forever.
            self.waiting.remove(seq)
            self.memory.release(seq)
            output.out_of_room.append(seq)
            return None
        if not self.memory.try_admit(seq, headroom_blocks=len(self.running) * self.memory.num_layers):
            return None
        self.waiting.remove(seq)
        seq.status = Status.PREFILLING
        self.prefilling.append(seq)
        return seq

    def admit_whole_prompts(self, output: SchedulerOutput) -> None:
        """Admit whole waiting prompts while the iteration stays within the token budget
        (the first prompt always may, however long, or it would never run)."""
        while True:
            candidates = [s for s in self.waiting if s.arrived_kv is None]
            if not candidates:
                return
            if output.prefills and output.num_tokens + candidates[0].num_to_prefill > self.config.token_budget:
                return
            seq = self.admit_next(output)
            if seq is None:
                return
            output.prefills.append(PrefillChunk(seq, seq.num_to_prefill))

    def _drop_active(self, seq: Sequence) -> None:
        for queue in (self.prefilling, self.running):
            if seq in queue:
                queue.remove(seq)
