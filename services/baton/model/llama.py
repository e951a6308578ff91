"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, Phi-3, Gemma 2/3, the MoE
families) with one forward for every use.

Design: the linear layers run once over a flat batch of N tokens that may come
from several sequences (SARATHI's ``[prefill chunk | decode tokens]``), while
attention runs per sequence ("segment") against that sequence's KV. Each
segment brings a ``SequenceKV`` that stores the new keys/values of a layer and
returns everything the new tokens attend to: a paged pool on a decode pod, a
dense list in a single-process prefill, or the previous rank's cache received
over torch.distributed in a KV-Runahead chain. An optional observer sees each
layer's queries and keys (PyramidInfer scores tokens with it).

Parameter names equal Hugging Face's, so a checkpoint loads as is. The layers are
``baton.model.layers``; what a forward takes and how its attention is split,
``baton.model.forward_batch``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from baton.host_memory import keep_freed_memory
from baton.host_to_device import to_device
from baton.kernels import cpu as cpu_kernels
from baton.kernels import flex_decode
from baton.kv.pool import PagedSequenceKV
from baton.model.config import ModelConfig
from baton.model.forward_batch import (
    AttentionObserver,
    AttentionPlan,
    DecodeBatch,
    Segment,
    SequenceKV,
    attention_kernels,
)
from baton.model.layers import Backbone
from baton.model.linear import Linear
from baton.model.rope import RotaryEmbedding
from baton.model.sharding import Collectives, HeadGather, ShardLayout, SingleRank


class CausalLM(nn.Module):
    """The whole model, or one tensor-parallel rank's shard of it (``layout``; its ranks run
    every forward together, through ``collectives``). ``config`` is the whole model's."""

    def __init__(self, config: ModelConfig, layout: ShardLayout | None = None,
                 collectives: Collectives | None = None) -> None:
        super().__init__()
        self.config = config
        self.layout = layout or ShardLayout(config)
        self.collectives = collectives or SingleRank()
        self.model = Backbone(config, self.layout, self.collectives)
        # what an attention observer reads under tensor parallelism: every rank's heads
        self.head_gather = HeadGather(self.layout, self.collectives) if self.layout.size > 1 else None
        # a tensor-parallel group's leader: the other ranks, told of each forward and logits
        # call this rank takes, to take theirs alongside (``baton.parallel.leader.Followers``)
        self.followers = None
        self.lm_head = Linear(config.hidden_size, self.layout.vocab_per_rank, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)
        # Gemma 3's sliding layers rotate by a RoPE of their own
        self.rotary_local = None if config.rope_local is None else RotaryEmbedding(config, config.rope_local)
        keep_freed_memory()

    def fuse_projections(self) -> CausalLM:
        """Run q/k/v and gate/up as one matmul each: fewer, larger kernels for decode.

        Best called once the weights are loaded and the model is on its final device
        and dtype (the loader and ``random_model`` do); a later move re-fuses on the
        first forward. Inference only.
        """
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.feed_forward.fuse()
        return self

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def reads_decode_cache_in_place(self, cache_dtype: torch.dtype, replayed: bool = False,
                                    rows: int = 1) -> bool:
        """Does decode attention read the paged cache (of ``cache_dtype``) where it lies
        (baton's CPU kernel; on CUDA, in a step of ``rows`` rows ``replayed`` from a graph,
        FlexAttention's where ``flex_decode.wanted``), rather than gathering each group of
        sequences into padded tensors? Then the pool need not cut a decode batch into groups
        of similar width. Not under a sliding window nor soft-capping, and only a cache in the
        compute dtype (the kernels do not convert: an fp8 cache is gathered and read back)."""
        config = self.config
        return (config.sliding_window is None and config.attn_logit_softcapping is None
                and cache_dtype == self.dtype
                and any(fits(self.dtype, self.device, config.head_dim, self.layout.num_heads,
                             self.layout.num_kv_heads)
                        for fits in (cpu_kernels.paged_decode_fits,
                                     *([flex_decode.fits] if replayed and flex_decode.wanted(rows)
                                       else []))))

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
        if self.followers is None:
            return self._forward(token_ids, positions, segments, output_rows, decode)
        with self.followers.forward(token_ids, positions, segments, output_rows, decode):
            return self._forward(token_ids, positions, segments, output_rows, decode)

    def _forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                 segments: Sequence[Segment], output_rows: torch.Tensor | None,
                 decode: DecodeBatch | None) -> torch.Tensor:
        hidden = self.model.embed(token_ids)
        rotations = self.rotary.cos_sin(positions, hidden.dtype)
        local_rotations = (None if self.rotary_local is None
                           else self.rotary_local.cos_sin(positions, hidden.dtype))
        plan = AttentionPlan(segments, decode, token_ids.shape[0], len(self.model.layers),
                             self.head_gather)
        if decode is not None:
            plan.in_place = self.reads_decode_cache_in_place(decode.step.k_cache.dtype, decode.replayed,
                                                             decode.size)
        # The last layer's output is read at ``output_rows`` only. Its K,V are stored for
        # every row (the cache needs them), and an observer still sees every row's query
        # (PyramidInfer scores with queries and keys, not outputs), but its attention,
        # o_proj and MLP run for those rows alone: a prompt's chunk then skips a layer's
        # worth of work on all but its last token (a chain's non-tail rank on all of them).
        # Not for a decode-only batch, whose rows are all wanted.
        narrow = bool(segments)
        wanted = ([] if output_rows is None else output_rows.tolist()) if narrow else None
        last = len(self.model.layers) - 1
        config = self.config
        with attention_kernels(hidden.device):
            for layer_index, layer in enumerate(self.model.layers):
                cos, sin = local_rotations if config.uses_local_rope(layer_index) else rotations
                q, k, v = layer.self_attn.project(layer.input_layernorm(hidden), cos, sin)
                rows = wanted if layer_index == last else None
                out = plan.attend(layer_index, q, k, v, positions,
                                  config.layer_sliding_window(layer_index), rows,
                                  config.attn_logit_softcapping)
                if rows is not None:
                    if not rows:
                        return hidden[:0]
                    hidden, out = hidden[output_rows], out[output_rows]  # fresh tensors
                # In place: the residual stream is this forward's own tensor (fresh from the
                # embedding), and a 4096-token step would otherwise allocate two per layer.
                layer.add_attention(hidden, out.reshape(out.shape[0], -1))
                layer.add_feed_forward(hidden)
        if output_rows is None:
            return hidden[:0]
        return self.model.norm(hidden if wanted is not None else hidden[output_rows])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] final hidden states -> [R, vocab] logits in fp32."""
        if self.followers is None:
            return self._logits(hidden)
        with self.followers.logits(hidden):
            return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.layout.size > 1:  # each rank's run of the vocabulary, then the padding cut off
            logits = self.collectives.all_gather(logits, dim=1)[:, :self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


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
