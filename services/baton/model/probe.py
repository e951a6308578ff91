"""Timing probes: the runtime measures a few choices on the machine it runs on (bf16 or
fp32, matmul orientation, the token budget) instead of trusting constants tuned elsewhere."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def fastest_run_s(run: Callable[[], object], runs: int, warmup: int = 1,
                  device: torch.device | None = None) -> float:
    """Wall seconds of the fastest of ``runs`` calls after ``warmup`` untimed ones (the first
    call of a shape also builds its kernels, a cost paid once). On a CUDA ``device`` the
    queued work is waited for around each timed call."""
    def synchronize() -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        run()
    fastest = float("inf")
    for _ in range(runs):
        synchronize()
        started = time.perf_counter()
        run()
        synchronize()
        fastest = min(fastest, time.perf_counter() - started)
    return fastest
