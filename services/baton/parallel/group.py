"""A tensor-parallel group: one process per device over torch.distributed (NCCL on GPUs, gloo on
CPUs), and the collective steps a sharded model takes (``baton.model.sharding.Collectives``).

Rank 0 leads: it runs the engine and tells the others what to compute (``baton.parallel.leader``);
the others follow (``baton.parallel.follower``). What rank 0 says goes by ``broadcast``, a
pickled message: the few tensors of a step's metadata, never a cache's worth.

The group is a process group of its own, not torch.distributed's default one: a prefill chain's
rank is a member of its chain (the default group, across pods) and leads its own tensor-parallel
group (within its pod) at once.
"""

from __future__ import annotations

import pickle
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
        self._store = dist.TCPStore(address, port, size, is_master=rank == 0, timeout=timeout,
                                    master_listen_fd=listen_fd)
        store = dist.PrefixStore("tensor-parallel", self._store)
        self.backend = resolve_backend(backend, self.device)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self._group = dist.ProcessGroupGloo(store, rank, size, timeout)
        # NCCL moves device tensors only: a message's bytes go through the device there
        self._wire_device = self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        self._group.allreduce([tensor]).wait()

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._group.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, message: object = None) -> object:
        """Rank 0's ``message`` on every rank (the others pass nothing): its length, then its
        pickled bytes."""
        payload = pickle.dumps(message) if self.leads else b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self._wire_device)
        self._broadcast_tensor(length)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self._wire_device)
                if self.leads else torch.empty(int(length.item()), dtype=torch.uint8,
                                               device=self._wire_device))
        self._broadcast_tensor(data)
        return message if self.leads else pickle.loads(data.cpu().numpy().tobytes())

    def _broadcast_tensor(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([tensor], options).wait()

    def barrier(self) -> None:
        self.all_reduce_(torch.zeros(1, device=self._wire_device))

    def close(self) -> None:
        self._group = None
        self._store = None
