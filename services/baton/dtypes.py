"""The tensor dtypes baton computes in and ships, by the names configs and the KV wire use.

A leaf module: the model loader and the KV wire codec both read it, so the KV layer
needs nothing from the model layer above it.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The name ``DTYPES`` knows ``dtype`` by (raises ValueError for any other)."""
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"KV dtype {dtype} cannot be shipped; supported: {sorted(DTYPES)}")
