"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2) with one forward for every use.

Design: the linear layers run once over a flat batch of N tokens that may come
from several sequences (SARATHI's ``[prefill chunk | decode tokens]``), while
attention runs per sequence ("segment") against that sequence's KV. Each
segment brings a ``SequenceKV`` that stores the new keys/values of a layer and
returns everything the new tokens attend to: a paged pool on a decode pod, a
dense list in a single-process prefill, or the previous rank's cache received
over torch.distributed in a KV-Runahead chain. An optional observer sees each
layer's queries and keys (PyramidInfer scores tokens with it).

Parameter names equal Hugging Face's, so a checkpoint loads as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from baton.host_memory import keep_freed_memory
from baton.host_to_device import to_device
from baton.kernels import cpu as cpu_kernels
from baton.kv.decode_step import DecodeGroup, DecodeStep
from baton.kv.pool import PagedSequenceKV
from baton.model.attention import attend, attend_decode_batch, decode_attention_bias
from baton.model.config import ModelConfig
from baton.model.linear import Linear, WeightPack, project
from baton.model.rope import RotaryEmbedding, apply_rotary


class SequenceKV(Protocol):
    """The KV cache of one sequence, as the model sees it during a forward."""

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store layer ``layer``'s new k, v ([T, Hkv, D]) at ``positions`` ([T]) and return
        (keys [S, Hkv, D], values, key_positions [S]): the cached prefix, then the new ones."""
        ...


class AttentionObserver(Protocol):
    """Sees every layer's queries and keys of one segment (PyramidInfer scores a prompt
    with it)."""

    def observe(self, layer: int, q: torch.Tensor, query_positions: torch.Tensor,
                k: torch.Tensor, key_positions: torch.Tensor) -> None:
        ...


class DecodeObserver(Protocol):
    """Sees a generated token's queries, every layer's at once, when the decode batch's
    forward has computed them (PyramidInfer's generation phase records them and scores
    later, from the pool; it needs no keys, so the batch reads the cache where it lies)."""

    def observe_decode(self, queries: torch.Tensor, position: int) -> None:
        """queries: [layers, H, D] of the token at ``position``."""
        ...


@dataclass
class Segment:
    """``length`` consecutive tokens of the flat batch that belong to one sequence."""

    length: int
    kv: SequenceKV
    observer: AttentionObserver | None = None


@dataclass
class DecodeBatch:
    """The last B rows of the flat batch: one new token for each of B sequences whose KV
    lies in a paged pool. The caller (a runner) builds ``step`` with ``KVPool.begin_decode``;
    the model writes and reads the cache through it. ``observers[b]`` sees row b's queries.
    With ``record_queries`` the forward leaves every row's queries of every layer in
    ``queries`` ([B, layers, H, D]) instead: a CUDA graph's replay hands them to the observers
    after the fact, since calling them is host work a graph cannot hold."""

    step: DecodeStep
    observers: Sequence[DecodeObserver | None] = ()
    record_queries: bool = False
    queries: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.step.slots.shape[1]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.elementwise_fits(x, self.weight) and x.is_contiguous():
            return cpu_kernels.kernels().rms_norm(x, self.weight, self.eps)  # one pass
        dtype = x.dtype
        # One fused kernel for x / rms(x) in fp32, then Llama's cast back before the weight.
        x32 = F.rms_norm(x.to(torch.float32), self.weight.shape, eps=self.eps)
        return x32.to(dtype).mul_(self.weight)  # a fresh tensor either way: scale it in place


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.qkv: _FusedLinear | None = None

    def fuse(self) -> None:
        """One matmul for q, k and v (see ``CausalLM.fuse_projections``)."""
        self.qkv = _FusedLinear(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [N, hidden] -> q [N, H, D], k, v [N, Hkv, D], RoPE applied to q and k."""
        n = x.shape[0]
        if self.qkv is not None:
            fused = self.qkv.output(x)
            if cpu_kernels.elementwise_fits(fused) and self.head_dim % 32 == 0:
                # RoPE in place on the q and k heads of the fused output, one pass
                cpu_kernels.kernels().rotary_(fused, cos.view(n, -1), sin.view(n, -1),
                                              self.num_heads + self.num_kv_heads, self.head_dim)
                q, k, v = fused.split(self.qkv.sizes, dim=-1)
                return (q.view(n, self.num_heads, self.head_dim),
                        k.view(n, self.num_kv_heads, self.head_dim),
                        v.view(n, self.num_kv_heads, self.head_dim))
            q, k, v = fused.split(self.qkv.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


# On the CPU a prompt-sized batch goes through the MLP in blocks of rows whose gate/up
# activations take about this much. Whole, an 8192-token step's are ~45 MiB in fp32 (the
# shipped model): more than the L3 cache, and more than glibc serves from its heap (32
# MiB at most), so every layer of every such step had them page-faulted in anew.
MLP_BLOCK_BYTES = 8 * 2**20
MLP_MIN_BLOCK_ROWS = 256  # below this, matmuls use the CPU less well


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up: _FusedLinear | None = None

    def fuse(self) -> None:
        """One matmul for gate and up (see ``CausalLM.fuse_projections``)."""
        self.gate_up = _FusedLinear(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.block_rows(x)
        if x.shape[0] <= rows:
            return self._forward(x)
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], rows):  # rows are independent: same result
            out[start:start + rows] = self._forward(x[start:start + rows])
        return out

    def block_rows(self, x: torch.Tensor) -> int:
        """How many rows go through at once (all of them on a GPU)."""
        if x.device.type != "cpu":
            return x.shape[0]
        row_bytes = 2 * self.gate_proj.out_features * x.element_size()
        return max(MLP_MIN_BLOCK_ROWS, MLP_BLOCK_BYTES // row_bytes)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            fused = self.gate_up.output(x)
            if cpu_kernels.elementwise_fits(fused) and fused.shape[1] % 32 == 0:
                return self.down_proj(cpu_kernels.kernels().silu_and_mul(fused))  # one pass
            gate, up = fused.split(self.gate_up.sizes, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate).mul_(up))


class _FusedLinear:
    """Several linear layers over the same input as one matmul.

    The layers' weights become row slices (views) of one concatenated matrix, so
    memory is not doubled, the Hugging Face parameter names stay, and a later
    ``load_state_dict`` writes through to the fused matrix. Moving the model to
    another device or dtype gives the layers new tensors of their own; the next
    call notices (the first layer's weight is no longer the fused matrix's first
    rows) and fuses them again on their new device.
    Inference only: the views are not leaves of their own for autograd.
    """

    def __init__(self, *layers: nn.Linear) -> None:
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self.pack = WeightPack()
        self._fuse()

    def _fuse(self) -> None:
        layers = self.layers
        with torch.no_grad():
            self.weight = torch.cat([layer.weight for layer in layers])
            has_bias = [layer.bias is not None for layer in layers]
            assert all(has_bias) or not any(has_bias), "fused layers must agree on bias"
            self.bias = torch.cat([layer.bias for layer in layers]) if has_bias[0] else None
        start = 0
        for layer, size in zip(layers, self.sizes, strict=True):
            layer.weight.data = self.weight[start:start + size]
            if self.bias is not None:
                layer.bias.data = self.bias[start:start + size]
            start += size

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' outputs side by side: [N, sum of out_features]."""
        if self.layers[0].weight.data_ptr() != self.weight.data_ptr():  # moved since fused
            self._fuse()
        return project(x, self.weight, self.bias, self.pack)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.output(x).split(self.sizes, dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Backbone(nn.Module):
    """Hugging Face's ``model.*`` submodule: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)
        keep_freed_memory()

    def fuse_projections(self) -> CausalLM:
        """Run q/k/v and gate/up as one matmul each: fewer, larger kernels for decode.

        Best called once the weights are loaded and the model is on its final device
        and dtype (the loader and ``random_model`` do); a later move re-fuses on the
        first forward. Inference only.
        """
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def reads_decode_cache_in_place(self) -> bool:
        """Does decode attention read the paged cache where it lies (baton's CPU kernel),
        rather than gathering each group of sequences into padded tensors? Then the pool
        need not cut a decode batch into groups of similar width. Not under a sliding
        window."""
        config = self.config
        return (config.sliding_window is None
                and cpu_kernels.paged_decode_fits(self.dtype, self.device, config.head_dim,
                                                  config.num_attention_heads,
                                                  config.num_key_value_heads))

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                segments: Sequence[Segment], output_rows: torch.Tensor | None = None,
                decode: DecodeBatch | None = None) -> torch.Tensor:
        """Run the model over a flat batch and return the final hidden states of ``output_rows``.

        token_ids, positions: [N]; ``segments`` partition the first N - B tokens in order,
        ``decode`` (if any) the last B. output_rows: indices into N whose hidden states are
        wanted (default: none, as on non-tail ranks of a prefill chain). Returns
        [len(output_rows), hidden] after the final norm; ``logits()`` turns them into
        vocabulary scores.
        """
        covered = sum(s.length for s in segments) + (decode.size if decode else 0)
        assert covered == token_ids.shape[0], "segments and decode batch must cover the batch"
        hidden = self.model.embed_tokens(token_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        plan = _AttentionPlan(segments, decode, token_ids.shape[0], len(self.model.layers))
        if decode is not None:
            plan.in_place = self.reads_decode_cache_in_place()
        # The last layer's output is read at ``output_rows`` only. Its K,V are stored for
        # every row (the cache needs them), and an observer still sees every row's query
        # (PyramidInfer scores with queries and keys, not outputs), but its attention,
        # o_proj and MLP run for those rows alone: a prompt's chunk then skips a layer's
        # worth of work on all but its last token (a chain's non-tail rank on all of them).
        # Not for a decode-only batch, whose rows are all wanted.
        narrow = bool(segments)
        wanted = ([] if output_rows is None else output_rows.tolist()) if narrow else None
        last = len(self.model.layers) - 1
        with _attention_kernels(hidden.device):
            for layer_index, layer in enumerate(self.model.layers):
                attn = layer.self_attn
                q, k, v = attn.project(layer.input_layernorm(hidden), cos, sin)
                rows = wanted if layer_index == last else None
                out = plan.attend(layer_index, q, k, v, positions, self.config.sliding_window, rows)
                if rows is not None:
                    if not rows:
                        return hidden[:0]
                    hidden, out = hidden[output_rows], out[output_rows]  # fresh tensors
                # In place: the residual stream is this forward's own tensor (fresh from the
                # embedding), and a 4096-token step would otherwise allocate two per layer.
                hidden.add_(attn.o_proj(out.reshape(out.shape[0], -1)))
                hidden.add_(layer.mlp(layer.post_attention_layernorm(hidden)))
        if output_rows is None:
            return hidden[:0]
        return self.model.norm(hidden if wanted is not None else hidden[output_rows])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] final hidden states -> [R, vocab] logits in fp32."""
        return self.lm_head(hidden).float()


# On CUDA, PyTorch may pick cuDNN's attention for a masked call, and cuDNN builds an
# execution plan for every new shape (milliseconds each). A decode batch's padded
# key span grows by a block every few steps, so that cost would recur all through
# generation; flash and memory-efficient attention have no per-shape setup.
_GPU_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                           SDPBackend.MATH]


def _attention_kernels(device: torch.device):
    return sdpa_kernel(_GPU_ATTENTION_BACKENDS) if device.type == "cuda" else nullcontext()


class _AttentionPlan:
    """How one forward's attention is split: every segment on its own against its
    ``SequenceKV``; the decode batch (if any) group by group, each group of sequences of
    similar length in one padded kernel call."""

    def __init__(self, segments: Sequence[Segment], decode: DecodeBatch | None,
                 num_rows: int, num_layers: int) -> None:
        self.segments: list[tuple[int, Segment]] = []
        row = 0
        for segment in segments:
            self.segments.append((row, segment))
            row += segment.length
        self.decode = decode
        self.num_layers = num_layers
        self.observed = False  # are the decode batch's queries observed
        self.keeps_queries = False  # observed, or recorded for later (DecodeBatch.record_queries)
        if decode is not None:
            self.decode_rows = slice(row, num_rows)
            self.observed = any(observer is not None for observer in decode.observers)
            self.keeps_queries = self.observed or decode.record_queries
            self.in_place = False  # read the cache where it lies (set by the model)
            self._biases: dict[int, torch.Tensor] = {}  # per group, shared by same-shape layers
            self._decode_queries: list[torch.Tensor] = []  # each layer's, while observed

    def attend(self, layer: int, q, k, v, positions, sliding_window,
               rows: Sequence[int] | None = None) -> torch.Tensor:
        """Every row's k, v go to its cache; returns [N, H, D], the attention output of every
        row, or (given ``rows``) of the decode batch and of each segment from its first row
        among ``rows`` to its end (other rows are left unset)."""
        out = torch.empty_like(q)
        for row, segment in self.segments:
            end = row + segment.length
            k_all, v_all, key_positions = segment.kv.extend(layer, k[row:end], v[row:end],
                                                            positions[row:end])
            if segment.observer is not None:
                segment.observer.observe(layer, q[row:end], positions[row:end], k_all, key_positions)
            first = row
            if rows is not None:  # from this segment's first wanted row on (usually its last)
                inside = [r for r in rows if row <= r < end]
                if not inside:
                    continue
                first = min(inside)  # to the end: attend() takes the segment's last queries
            out[first:end] = attend(q[first:end], k_all, v_all, positions[first:end],
                                    key_positions, sliding_window)
        if self.decode is not None:
            self._attend_decode(layer, q, k, v, positions, sliding_window, out)
        return out

    def _attend_decode(self, layer, q, k, v, positions, sliding_window, out) -> None:
        rows, step = self.decode_rows, self.decode.step
        step.write(layer, k[rows], v[rows], positions[rows])
        q, positions, out = q[rows], positions[rows], out[rows]  # views of the decode rows
        for index, group in enumerate(step.groups):
            self._attend_group(index, group, layer, q, positions, sliding_window, out)
        if self.keeps_queries:
            self._decode_queries.append(q)
            if layer == self.num_layers - 1:
                queries = torch.stack(self._decode_queries, dim=1)  # [B, layers, H, D]
                if self.decode.record_queries:
                    self.decode.queries = queries
                if self.observed:
                    observe_decode(self.decode.observers, queries, positions.tolist())

    def _attend_group(self, index: int, group: DecodeGroup, layer: int, q, positions,
                      sliding_window, out) -> None:
        rows, step = group.rows, self.decode.step
        if self.in_place:
            out[rows] = cpu_kernels.kernels().paged_decode_attention(
                q[rows].contiguous(), step.k_cache, step.v_cache, group.blocks[layer],
                group.lengths[layer])
            return
        k_pad, v_pad, key_positions, lengths = step.read(
            group, layer, with_positions=sliding_window is not None)
        bias = self._biases.get(index)
        if bias is None or not group.uniform or sliding_window is not None:
            bias = decode_attention_bias(positions[rows], key_positions, lengths, k_pad.shape[1],
                                         sliding_window, q.dtype)
            self._biases[index] = bias
        out[rows] = attend_decode_batch(q[rows], k_pad, v_pad, bias)


def observe_decode(observers: Sequence[DecodeObserver | None], queries: torch.Tensor,
                   positions: Sequence[int]) -> None:
    """Each observer gets its row's queries of every layer (queries: [B, layers, H, D]): one
    call per sequence, none per sequence and layer."""
    for observer, query, position in zip(observers, queries.unbind(0), positions):
        if observer is not None:
            observer.observe_decode(query, position)


# --- The two entry points the engines call -------------------------------------------------


def prefill(model: CausalLM, token_ids: torch.Tensor, positions: torch.Tensor, kv: SequenceKV,
            observer: AttentionObserver | None = None, want_logits: bool = True) -> torch.Tensor | None:
    """Prefill one slice of a prompt at absolute ``positions`` over ``kv``'s prefix.

    Returns the logits of the slice's last token ([vocab], fp32), or None when
    ``want_logits`` is False (a non-tail rank of a chain).
    """
    rows = to_device([token_ids.shape[0] - 1], token_ids.device) if want_logits else None
    hidden = model(token_ids, positions, [Segment(token_ids.shape[0], kv, observer)], rows)
    return model.logits(hidden)[0] if want_logits else None


def decode_step(model: CausalLM, token_ids: torch.Tensor, positions: torch.Tensor,
                kvs: Sequence[SequenceKV]) -> torch.Tensor:
    """One new token for each of B sequences of different lengths -> logits [B, vocab].

    Sequences of one paged pool are attended as a decode batch; any other caches
    one by one."""
    rows = torch.arange(token_ids.shape[0], device=token_ids.device)
    pools = {id(kv.pool) for kv in kvs if isinstance(kv, PagedSequenceKV)}
    if len(pools) == 1 and all(isinstance(kv, PagedSequenceKV) for kv in kvs):
        step = kvs[0].pool.begin_decode([kv.seq_id for kv in kvs])
        hidden = model(token_ids, positions, [], rows, DecodeBatch(step))
    else:
        hidden = model(token_ids, positions, [Segment(1, kv) for kv in kvs], rows)
    return model.logits(hidden)
