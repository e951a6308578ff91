"""How a model's weights are cut over the ranks of a tensor-parallel group (Megatron's layout).

* q/k/v and gate/up (an expert's too) are column-parallel: each rank holds its heads' or its
  part of the intermediate width's rows, so attention and the activation run on local data;
* o and down are row-parallel: each rank holds the matching columns and adds a partial sum,
  completed by one all-reduce each (``DecoderLayer``);
* the embedding and the LM head are vocabulary-parallel: each rank holds a contiguous run of
  the vocabulary's rows (the vocabulary padded to a multiple of the group's size), the
  embedding's partial lookups are all-reduced and the LM head's logits all-gathered;
* the norms, the router of a mixture of experts and RoPE are replicated.

KV heads are split like the query heads when there are at least as many as ranks; with fewer,
each is replicated over ``size / num_kv_heads`` consecutive ranks, which is where the query
heads that read it lie. Either way a rank's query heads attend to its own KV heads only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from baton.model.config import ModelConfig

# parameter name (its projection) -> the dimension cut and what it is cut by
COLUMN_PARALLEL = {"q_proj": "heads", "k_proj": "kv_heads", "v_proj": "kv_heads",
                   "gate_proj": "intermediate", "up_proj": "intermediate",
                   "w1": "intermediate", "w3": "intermediate"}
ROW_PARALLEL = {"o_proj": "heads", "down_proj": "intermediate", "w2": "intermediate"}
VOCABULARY_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class ShardLayout:
    """Rank ``rank``'s part of a model over a group of ``size`` ranks."""

    config: ModelConfig
    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        check_divisible(self.config, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside a group of {self.size}")

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_key_value_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        """The first of this rank's KV heads in the model's numbering."""
        kv = self.config.num_key_value_heads
        if kv >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank * kv // self.size  # replicated: size // kv consecutive ranks share one

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def expert_intermediate_size(self) -> int:
        return self.config.expert_intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full parameter ``name`` (a copy only where it is cut)."""
        if self.size == 1:
            return tensor
        if name in VOCABULARY_PARALLEL:
            return self._vocabulary_rows(tensor)
        parts = name.split(".")
        if len(parts) < 2:
            return tensor
        projection, kind = parts[-2], parts[-1]
        if projection in COLUMN_PARALLEL:
            return self._rows(tensor, 0, COLUMN_PARALLEL[projection])
        if projection in ROW_PARALLEL and kind == "weight":
            return self._rows(tensor, 1, ROW_PARALLEL[projection])
        if projection in ROW_PARALLEL:
            raise ValueError(f"{name}: a row-parallel projection's bias is not supported under "
                             "tensor parallelism")
        return tensor

    def _rows(self, tensor: torch.Tensor, dim: int, cut_by: str) -> torch.Tensor:
        head_dim = self.config.head_dim
        if cut_by == "heads":
            start, count = self.rank * self.num_heads * head_dim, self.num_heads * head_dim
        elif cut_by == "kv_heads":
            start, count = self.first_kv_head * head_dim, self.num_kv_heads * head_dim
        else:
            count = tensor.shape[dim] // self.size  # an expert's or the dense MLP's width
            start = self.rank * count
        return tensor.narrow(dim, start, count).contiguous()

    def _vocabulary_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = tensor[self.vocab_start:self.vocab_start + self.vocab_per_rank]
        if rows.shape[0] == self.vocab_per_rank:
            return rows.contiguous()
        padded = tensor.new_zeros((self.vocab_per_rank,) + tuple(tensor.shape[1:]))
        padded[:rows.shape[0]] = rows  # the padding's logits are cut off after the gather
        return padded


def check_divisible(config: ModelConfig, size: int) -> None:
    """Raise ValueError naming what a group of ``size`` ranks cannot split evenly."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size {size} must be at least 1")
    if size == 1:
        return
    problems = []
    kv = config.num_key_value_heads
    if config.num_attention_heads % size:
        problems.append(f"num_attention_heads {config.num_attention_heads}")
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads {kv} (neither divides the other)")
    has_dense_mlp = config.num_experts == 0 or config.mlp_only_layers or config.decoder_sparse_step > 1
    if has_dense_mlp and config.intermediate_size % size:
        problems.append(f"intermediate_size {config.intermediate_size}")
    if config.num_experts and config.expert_intermediate_size % size:
        problems.append(f"an expert's intermediate size {config.expert_intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                         + ", ".join(problems) + "; choose a size that does")


class Collectives(Protocol):
    """The collective steps a sharded model's forward takes, every rank alike (a
    tensor-parallel group: ``baton.parallel.group``), and which rank of how many this is."""

    size: int
    rank: int

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``tensor`` (alike in shape) joined along ``dim``, rank 0's first."""


class HeadGather:
    """Every head of tensors whose ranks each hold their own heads (at dim -2): what an
    observer of attention reads, so that PyramidInfer under tensor parallelism scores with
    the queries and keys it scores with in one process, and keeps the same tokens."""

    def __init__(self, layout: ShardLayout, collectives: Collectives) -> None:
        self.layout = layout
        self.collectives = collectives

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """[..., H / size, D] on each rank -> [..., H, D] (query heads are never replicated)."""
        return self.collectives.all_gather(q.contiguous(), dim=q.dim() - 2)

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """[..., Hkv / size, D] on each rank -> [..., Hkv, D]; a KV head that several ranks
        hold (fewer KV heads than ranks) is taken once."""
        dim = k.dim() - 2
        every = self.collectives.all_gather(k.contiguous(), dim=dim)
        num_kv_heads, size = self.layout.config.num_key_value_heads, self.layout.size
        if num_kv_heads >= size:
            return every
        ranks = torch.arange(0, size, size // num_kv_heads, device=k.device)  # one per head
        return every.index_select(dim, ranks)


class SingleRank:
    """A model that is not sharded: every collective is the identity."""

    size = 1
    rank = 0

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        pass

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor
