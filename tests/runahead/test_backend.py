"""Which torch.distributed backend a chain of local processes gets."""

from __future__ import annotations

import pytest
import torch
from baton.runahead.worker import local_backend


@pytest.mark.parametrize(("gpus", "ranks", "expected"), [
    (0, 1, "gloo"), (0, 2, "gloo"),
    (1, 1, "nccl"), (1, 2, "gloo"),  # NCCL refuses two ranks on one GPU
    (2, 2, "nccl"), (4, 3, "nccl"),
])
def test_auto_is_nccl_only_with_a_gpu_for_every_rank(monkeypatch, gpus, ranks, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert local_backend("auto", ranks) == expected


def test_an_explicit_backend_is_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_backend("nccl", 2) == "nccl" and local_backend("gloo", 1) == "gloo"
