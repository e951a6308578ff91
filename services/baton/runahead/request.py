"""What goes into a chain and what comes out of it, and where each rank's model comes from.

``ChainRequest`` is built by ``make_request``, which validates everything (the
prompt against the model, the partition against the chain) before any rank
sees it; ``ChainResult`` is what the tail hands to its sink: the first token's
logits, the full KV cache as ``list[LayerKV]`` (what ``KVPool.store`` and the
KV wire codec take), the partition used, the time to first token and every
rank's counters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from baton.config import RUNAHEAD_MODES
from baton.kv import LayerKV
from baton.model import CausalLM, ModelConfig, load_checkpoint
from baton.model.limits import check_prompt_ids
from baton.model.presets import PRESETS, random_model
from baton.model.tokenizer import Tokenizer
from baton.runahead.partition import even_boundaries, validate_boundaries
from baton.runahead.transport import RankCounters

MODES = RUNAHEAD_MODES  # the chain's modes, named once (the configuration's choices)


@dataclass(frozen=True)
class ModelSource:
    """A picklable recipe for a rank's model: a checkpoint directory or a random-weight preset."""

    path: str = ""  # checkpoint directory; empty with no preset = the shipped model
    preset: str = ""  # a name in ``baton.model.presets.PRESETS`` (random weights)
    seed: int = 0
    dtype: str = "auto"
    max_model_len: int = 0  # 0 = the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.preset and self.preset not in PRESETS:
            raise ValueError(f"unknown model preset {self.preset!r}; known: {sorted(PRESETS)}")
        if self.preset and self.path:
            raise ValueError(f"give a checkpoint path ({self.path!r}) or a preset "
                             f"({self.preset!r}), not both")

    def config(self) -> ModelConfig:
        if self.preset:
            return PRESETS[self.preset]
        from baton.model.hub import resolve_model

        config = ModelConfig.from_file(resolve_model(self.path).directory / "config.json")
        config.cap_context(self.max_model_len)
        return config

    def tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer (None for a preset: random weights have none)."""
        if self.preset:
            return None
        from baton.model.hub import resolve_model

        return Tokenizer.from_dir(resolve_model(self.path).directory)

    def load(self, device: torch.device) -> CausalLM:
        if self.preset:
            dtype = torch.float32 if self.dtype in ("auto", "float32") else getattr(torch, self.dtype)
            return random_model(self.preset, seed=self.seed, dtype=dtype, device=device)
        return load_checkpoint(self.path, dtype=self.dtype, device=device.type,
                               with_tokenizer=False, max_model_len=self.max_model_len).model


@dataclass
class ChainRequest:
    request_id: int
    token_ids: torch.Tensor  # [C] int64
    boundaries: list[int]  # [0=b0 <= b1 <= ... < bp=C]
    mode: str = "runahead"
    return_kv: bool = True  # False: the tail sends back only the logits (tuning, benchmarks)
    # What only the tail uses (the service's serialized PrefillRequest: sampling, compression,
    # the decode pod to push to), broadcast with the token ids; opaque to the chain.
    details: bytes = b""


@dataclass
class ChainResult:
    request_id: int
    first_token_logits: torch.Tensor  # [vocab] fp32: the prompt's last position
    layers: list[LayerKV] | None  # full (or compressed) cache; None unless requested
    boundaries: list[int]
    mode: str
    ttft_s: float  # the request's header reaching the tail -> the tail holding the logits (its clock)
    counters: list[RankCounters] = field(default_factory=list)  # one per rank
    details: bytes = b""  # the request's ``ChainRequest.details``

    def on_host(self) -> ChainResult:
        """This result with its tensors in host memory: what crosses a process boundary (a CUDA
        tensor on a queue would be shared through CUDA IPC, tying the receiver to the rank)."""
        layers = None if self.layers is None else [
            LayerKV(x.k.cpu(), x.v.cpu(), x.positions.cpu()) for x in self.layers]
        return dataclasses.replace(self, first_token_logits=self.first_token_logits.cpu(),
                                   layers=layers)

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.counters)


def make_request(request_id: int, token_ids, num_ranks: int, model_config: ModelConfig,
                 boundaries: list[int] | None = None, mode: str = "runahead",
                 return_kv: bool = True, details: bytes = b"") -> ChainRequest:
    """A validated request (raises ValueError naming the bad value). No boundaries = even slices."""
    if mode not in MODES:
        raise ValueError(f"chain mode {mode!r} is not one of {MODES}")
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).cpu()
    check_prompt_ids(ids.tolist(), model_config.vocab_size, model_config.max_position_embeddings)
    context_length = ids.shape[0]
    if boundaries is None:
        boundaries = even_boundaries(context_length, num_ranks)
    boundaries = validate_boundaries(boundaries, num_ranks, context_length)
    if mode == "tsp" and boundaries != even_boundaries(context_length, num_ranks):
        raise ValueError(f"TSP runs even slices {even_boundaries(context_length, num_ranks)}, "
                         f"got {boundaries}")
    return ChainRequest(request_id, ids, boundaries, mode, return_kv, details)
