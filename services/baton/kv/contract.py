"""``KVContract``: what a prefill chain ships and a decode pod takes, compared where they meet.

A chain's KV is only useful to a decode pod that reads it as the chain wrote it: the same
model and revision, the same KV dtype, the same shape of every layer (layers, KV heads,
head_dim) and the same wire layout (``HEADS_COMPLETE``: a chain ships every KV head, whatever
tensor parallelism either side runs). Every chain and decode pod publishes its contract in
its routing record, and the gateway never pairs two that mismatch (``mismatches``); the
decode pod checks each pushed cache's header against its own contract by the same rule, the
last line of defence while a rolling upgrade's records catch up.

What must match and what need not:

* model id and revision: always (an empty revision is a revision);
* KV dtype, layers, KV heads, head_dim, wire layout: when both sides say theirs (an empty
  value or 0 is "not said": a record of an earlier release, or a header, which says no more
  than its own shape);
* compression: when both sides compress, the same policy and keep ratio. A decode pod that
  compresses continues in generation the pruning the chain began in prefill, so mixing two
  settings would give one request neither deployment's answer; a pod that does not
  compress stores what it is given (a chain with compression off ships everything);
* block size and tensor-parallel size are information only: the wire carries tokens, not
  blocks, and every KV head, so a pod lands a cache in its own blocks and shards it over its
  own ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.config.scheduler import PyramidConfig

HEADS_COMPLETE = "heads-complete"  # every KV head of every layer, one layer after another
COMPRESSION_OFF = "off"


@dataclass(frozen=True)
class KVContract:
    model_id: str
    model_revision: str
    dtype: str = ""  # the KV's dtype by name ("bfloat16"); "" = not said
    kv_scale: float = 0.0  # what an fp8 cache is stored divided by (``baton.kv.storage``); 0 = not said
    num_layers: int = 0  # 0 = not said (as every count below)
    num_kv_heads: int = 0  # of the whole model, not of one rank
    head_dim: int = 0
    layout: str = ""  # what the wire carries (HEADS_COMPLETE); "" = not said
    # "off", or the policy and keep ratio that prune what a chain ships (``compression_of``);
    # "" = not said.
    compression: str = ""
    block_size: int = 0  # tokens per KV block in the pool (information)
    tensor_parallel_size: int = 1  # ranks the model is sharded over (information)

    def mismatches(self, other: KVContract) -> list[str]:
        """Why a cache under ``self`` cannot go to a side under ``other``, in words (``"kv
        dtype bfloat16 != float32"``, this side's value first); empty when they fit."""
        found = [f"{label} {mine!r} != {theirs!r}" for label, mine, theirs in (
            ("model", self.model_id, other.model_id),
            ("model revision", self.model_revision, other.model_revision)) if mine != theirs]
        for label, mine, theirs in (("kv dtype", self.dtype, other.dtype),
                                    ("kv scale", self.kv_scale, other.kv_scale),
                                    ("num layers", self.num_layers, other.num_layers),
                                    ("num kv heads", self.num_kv_heads, other.num_kv_heads),
                                    ("head_dim", self.head_dim, other.head_dim),
                                    ("kv layout", self.layout, other.layout)):
            if mine and theirs and mine != theirs:
                found.append(f"{label} {mine} != {theirs}")
        compressing = {self.compression, other.compression} - {"", COMPRESSION_OFF}
        if len(compressing) > 1:
            found.append(f"compression {self.compression} != {other.compression}")
        return found


def compression_of(pyramid: PyramidConfig) -> str:
    """The contract's words for a side's compression settings."""
    return f"{pyramid.policy} keep_ratio {pyramid.keep_ratio:g}" if pyramid.enabled else COMPRESSION_OFF
