"""The tensor dtypes baton computes in, stores KV in and ships, by the names configs and the
KV wire use.

A leaf module: the model loader and the KV wire codec both read it, so the KV layer
needs nothing from the model layer above it.
"""

from __future__ import annotations

import torch

# What a model computes in (``model.dtype``'s choices) and what a KV cache may be stored and
# shipped in: these, and the fp8 ones of ``KV_CACHE_DTYPES``.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}

# ``kv_cache.dtype``'s choices (vLLM's names): None = the compute dtype.
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def dtype_name(dtype: torch.dtype) -> str:
    """The name ``DTYPES`` knows ``dtype`` by (raises ValueError for any other)."""
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"KV dtype {dtype} cannot be shipped; supported: {sorted(DTYPES)}")
