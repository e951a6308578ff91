"""Tensor parallelism: how many processes (devices) one pod's model is sharded over."""

from __future__ import annotations

from baton.config.chain import CHAIN_BACKENDS
from baton.configtree import setting, settings


@settings("tensor_parallel")
class TensorParallelConfig:
    size: int = setting(1, "processes (one per device) the model is sharded over; rank 0 runs the "
                        "engine and the others follow it (baton.parallel)", minimum=1)
    backend: str = setting("auto", "torch.distributed backend: auto = nccl on CUDA, gloo on CPU",
                           choices=CHAIN_BACKENDS)
    timeout_s: float = setting(60.0, "a rank waiting longer than this on another gives up, and the "
                               "pod exits", exclusive_minimum=0)
