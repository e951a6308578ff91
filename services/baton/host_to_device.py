"""Small host-made tensors (block indices, positions, rows) sent to the model's device.

A plain ``torch.tensor(values, device="cuda")`` or ``cpu_tensor.to("cuda")`` is a
blocking copy: PyTorch synchronises the stream after it, so the CPU waits for
every kernel queued so far. A decode step that sent its block tables that way
(a few per layer) ran with the GPU idle while Python prepared the next kernel.
From pinned memory the copy is queued like a kernel and the CPU runs ahead;
PyTorch's caching host allocator keeps a pinned buffer until its copy has run.
"""

from __future__ import annotations

import array

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without stalling a GPU stream.

    ``values``: a list of numbers or a CPU tensor.
    """
    if isinstance(values, list) and dtype == torch.long:
        # Through a C array: faster than torch.as_tensor on a Python list (a decode step's
        # block tables are ~10k ints at batch 64).
        tensor = torch.frombuffer(array.array("q", values), dtype=torch.long) if values else \
            torch.empty(0, dtype=torch.long)
    else:
        tensor = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
