"""The tensor dtypes baton computes in and ships, by the names configs and the KV wire use.

A leaf module: the model loader and the KV wire codec both read it, so the KV layer
needs nothing from the model layer above it.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
