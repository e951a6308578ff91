"""A follower rank of a tensor-parallel group: load its shard, then do what the leader says.

The loop reads as its verbs: receive the leader's next message, then run the forward it
describes over this rank's own storage, compute its part of the logits, mirror a write or a
move into its storage, or stop. Every message is one broadcast and the collectives of the
work it names, in the order the leader takes them, so the group never deadlocks on its own.
A leader that dies breaks the next broadcast: the follower exits with it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from baton.model.loader import load_checkpoint, resolve_device
from baton.model.sharding import ShardLayout
from baton.parallel.group import TensorParallelGroup
from baton.parallel.step import Replica, read_every_head

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupPlace:
    """Where a rank joins its group and what it loads (every rank alike but ``rank``)."""

    size: int
    rank: int
    port: int
    model: str
    dtype: str = "auto"
    device: str = "auto"
    revision: str = ""
    max_model_len: int = 0
    backend: str = "auto"
    timeout_s: float = 60.0
    address: str = "127.0.0.1"
    cpu_threads: int = 0  # 0: torch's default
    with_tokenizer: bool = True  # the leader's (the followers never read text)

    def device_of_rank(self) -> torch.device:
        """On CUDA each rank has its own device (rank modulo the visible ones)."""
        device = resolve_device(self.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        return device

    def join(self) -> tuple[TensorParallelGroup, object]:
        """Join the group and load this rank's shard: (group, LoadedModel)."""
        if self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        device = self.device_of_rank()
        group = TensorParallelGroup(self.size, self.rank, self.port, self.address, self.backend,
                                    device, self.timeout_s)
        loaded = load_checkpoint(self.model, self.dtype, str(device), self.revision,
                                 with_tokenizer=self.with_tokenizer and self.rank == 0, max_model_len=self.max_model_len,
                                 group=group)
        group.barrier()  # every shard is in before the first step
        return group, loaded


def follow(place: GroupPlace) -> None:
    """A follower process's main: serve the leader until it says stop or goes away."""
    group, loaded = place.join()
    model = loaded.model
    layout: ShardLayout = model.layout
    replica = Replica(layout.num_kv_heads, loaded.config.head_dim, model.device,
                      model.head_gather, group)
    heads = slice(layout.first_kv_head, layout.first_kv_head + layout.num_kv_heads)
    try:
        while True:
            message = group.broadcast()
            kind = message[0]
            if kind == "stop":
                break
            if kind == "forward":
                model(*replica.forward_arguments(message))
            elif kind == "logits":
                model.logits(message[1].to(model.device))
            elif kind == "pool":
                replica.add_pool(message[1])
            elif kind == "write":
                _, key, index, k, v, positions = message
                replica.pools[key]._write_at(index.to(model.device), k[:, heads], v[:, heads], positions)
            elif kind == "read":
                _, key, blocks, length, with_values = message
                read_every_head(replica.pools[key], model.head_gather, blocks, length, with_values)
            elif kind == "move":
                _, key, source, target = message
                replica.pools[key].move_tokens(source.to(model.device), target.to(model.device))
            # "keepalive": nothing to do
    except Exception as e:  # noqa: BLE001 - the leader went away, or a step failed here: the group is broken
        log.error("tensor-parallel rank %d stops: %r", place.rank, e)
        os._exit(1)
    group.close()
    os._exit(0)  # nothing to tear down but the interpreter, which takes seconds with torch


if __name__ == "__main__":  # started by the leader: python -m baton.parallel.follower PLACE_JSON
    import json
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    follow(GroupPlace(**json.loads(sys.argv[1])))
