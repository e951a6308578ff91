"""The model a process serves, and the paged KV pool it keeps."""

from __future__ import annotations

from baton.configtree import setting, settings

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")  # baton.dtypes.KV_CACHE_DTYPES' names


@settings("model")
class ModelSourceConfig:
    path: str = setting("", "a Hugging Face checkpoint directory, or a repo id (org/name) found in "
                        "the local Hugging Face cache or downloaded into it; empty means the "
                        "shipped model")
    revision: str = setting("", "a repo id's branch, tag or commit (default main); for a "
                            "directory, the label pushed KV caches are checked against (empty: "
                            "its name)")
    served_model_name: list[str] = setting([], "the names clients call the model by (the OpenAI "
                                           "API's model field); the first is the one reported; "
                                           "empty = the checkpoint directory's name")
    dtype: str = setting("auto", "compute dtype: auto = bfloat16 on CUDA, and on a CPU whose bf16 "
                        "matmuls measure faster (AVX512-BF16/AMX), else float32", choices=DTYPES)
    device: str = setting("auto", "auto = cuda when available, else cpu", choices=DEVICES)
    threads: int = setting(0, "torch intra-op threads on CPU; 0 leaves torch's default", minimum=0)
    max_model_len: int = setting(0, "the longest sequence (prompt and generated tokens) served; "
                                 "0 = the model's max_position_embeddings", minimum=0)


def served_model_names(source: ModelSourceConfig, checkpoint_name: str) -> tuple[str, ...]:
    """The names clients call the model by, the reported one first: the configured names,
    else the checkpoint's."""
    return tuple(source.served_model_name) or (checkpoint_name,)


@settings("kv")
class KVPoolConfig:
    block_size: int = setting(16, "tokens per KV block", minimum=1)
    num_blocks: int = setting(0, "KV blocks in the pool; 0 derives it from memory_mib", minimum=0)
    memory_mib: int = setting(512, "memory for the KV pool when num_blocks and memory_fraction "
                              "are 0, in MiB", minimum=1)
    memory_fraction: float = setting(0.0, "the share of the device's memory still free once the "
                                     "weights are loaded that the KV pool takes, when num_blocks "
                                     "is 0 (as vLLM's --gpu-memory-utilization, of what is left); "
                                     "0 = memory_mib", minimum=0.0, maximum=1.0)
    unclaimed_lease_s: float = setting(30.0, "a decode pod frees KV a chain pushed when no Attach claims "
                                       "it within this long (the caller is gone)", exclusive_minimum=0)
    max_pending_pushes: int = setting(64, "KV uploads a decode pod receives at once; more get "
                                      "RESOURCE_EXHAUSTED (each holds a receive buffer)", minimum=1)
    prefix_cache: bool = setting(True, "keep the KV of prompts' full blocks after their request ends "
                                 "and reuse it for later prompts that start with the same tokens "
                                 "(same tenant, model revision and KV dtype); evicted least "
                                 "recently used when the pool needs room")


@settings("kv_cache")
class KVCacheConfig:
    """What the KV cache's bytes are, in the pool, the prefix cache and on the wire: a chain
    and the decode pods it ships to must agree (docs/architecture.md, "FP8 KV cache")."""

    dtype: str = setting("auto", "the KV cache's dtype: auto = the compute dtype; fp8_e4m3 or "
                         "fp8_e5m2 store and ship keys and values in one byte each (half of "
                         "bf16's), read back in the compute dtype", choices=KV_CACHE_DTYPES)
    scale: float = setting(1.0, "fp8 only: keys and values are stored divided by this one "
                           "per-tensor scale (every layer and head), saturated to fp8's range; "
                           "1.0 = uncalibrated, as vLLM's default", exclusive_minimum=0)
