"""A tensor-parallel group: one process per device over torch.distributed (NCCL on GPUs, gloo on
CPUs), and the collective steps a sharded model takes (``baton.model.sharding.Collectives``).

Rank 0 leads: it runs the engine and tells the others what to compute (``baton.parallel.leader``);
the others follow (``baton.parallel.follower``). What rank 0 says goes by ``broadcast``, a
pickled message: the few tensors of a step's metadata, never a cache's worth.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallelGroup:
    """This process's rank among ``size``; joining blocks until every rank has joined (or
    ``timeout_s`` passes). A collective that waits longer than ``timeout_s`` on a peer raises."""

    def __init__(self, size: int, rank: int, port: int, address: str = "127.0.0.1",
                 backend: str = "auto", device: torch.device | None = None,
                 timeout_s: float = 60.0) -> None:
        self.size = size
        self.rank = rank
        self.device = device or torch.device("cpu")
        self.timeout_s = timeout_s
        timeout = timedelta(seconds=timeout_s)
        listen_fd = None
        if rank == 0:  # the rendezvous listens on the leader's address alone
            listen_fd = socket.create_server((address, port), backlog=size * 16).detach()
        store = dist.TCPStore(address, port, size, is_master=rank == 0, timeout=timeout,
                              master_listen_fd=listen_fd)
        dist.init_process_group(resolve_backend(backend, self.device), store=store, rank=rank,
                                world_size=size, timeout=timeout,
                                device_id=self.device if self.device.type == "cuda" else None)

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts, dim=dim)

    def broadcast(self, message: object = None) -> object:
        """Rank 0's ``message`` on every rank (the others pass nothing)."""
        box = [message]
        dist.broadcast_object_list(box, src=0,
                                   device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
