"""The architecture of a Llama-family checkpoint, read from its ``config.json``.

Supports Hugging Face's LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM (per-head q/k RMSNorm, an explicit head_dim), the sparse mixtures of
experts MixtralForCausalLM and Qwen3MoeForCausalLM, Phi3ForCausalLM (projections fused in
its checkpoints, ``baton.model.weight_names``; LongRoPE over part of each head), and
Gemma2ForCausalLM and Gemma3ForCausalLM (GEMMA_FAMILIES' layout, soft-capping, sliding and
global layers, Gemma 3's local RoPE), in both the transformers-4 layout (``rope_theta`` +
``rope_scaling``) and the transformers-5 layout (``rope_parameters``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from baton.model.errors import CheckpointError
from baton.model.generation_config import GenerationConfig

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# transformers' model_type where it is not the family's name
MODEL_TYPES = {"gemma3": "gemma3_text"}
# Gemma's layout: embeddings scaled by sqrt(hidden_size), RMSNorm weights stored as w - 1
# (the norm scales by 1 + w, in fp32), and every sublayer's output normed too before it joins
# the residual stream ("sandwich" norms: post_attention, pre_ and post_feedforward).
GEMMA_FAMILIES = ("gemma2", "gemma3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP's activation
LAYER_TYPES = ("sliding_attention", "full_attention")
# Families whose sliding_window (when set) masks keys older than that in every layer
SLIDING_WINDOW_FAMILIES = ("mistral", "mixtral", "phi3")
# Families that normalise each head's queries and keys (RMSNorm over head_dim) before RoPE.
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# RoPE scalings defined against the context the checkpoint was pretrained with
ROPE_TYPES_WITH_ORIGINAL_CONTEXT = ("llama3", "yarn", "longrope")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048  # the longest sequence served (see cap_context)
    # config.json's max_position_embeddings, which RoPE scalings are defined against
    # (0 = max_position_embeddings; cap_context leaves it)
    checkpoint_max_position_embeddings: int = 0
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"
    attention_bias: bool = False  # q/k/v biases (always on for Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3)
    # A sparse mixture of experts (Mixtral, Qwen3-MoE): 0 experts = a dense MLP everywhere
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k routing
    moe_intermediate_size: int = 0  # an expert's width (0 = intermediate_size)
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1
    decoder_sparse_step: int = 1  # Qwen3-MoE: every this many layers is sparse ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... but these, dense
    sliding_window: int | None = None  # Mistral: a key older than this many positions is masked
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    # Gemma 2/3 (and see GEMMA_FAMILIES)
    hidden_act: str = "silu"  # the gated MLP's activation, one of ACTIVATIONS
    query_pre_attn_scalar: float = 0.0  # scores scaled by its -1/2 power (0: by head_dim's)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    # Per layer, "sliding_attention" (sliding_window applies) or "full_attention"; empty:
    # sliding_window, if any, applies to every layer (Mistral, Phi-3)
    layer_types: list[str] = field(default_factory=list)
    rope_local: dict[str, Any] | None = None  # the sliding layers' own RoPE (Gemma 3)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.checkpoint_max_position_embeddings == 0:
            self.checkpoint_max_position_embeddings = self.max_position_embeddings
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                             f"1..num_experts {self.num_experts}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}; "
                             f"supported: {sorted(ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")
        for rope in (self.rope, self.rope_local or {}):
            if rope.get("rope_type", "default") not in ROPE_TYPES:
                raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}; "
                                 f"supported: {ROPE_TYPES}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden activation {self.hidden_act!r}; supported: {ACTIVATIONS}")
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers
                                 or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ValueError(f"layer_types must name one of {LAYER_TYPES} for each of the "
                             f"{self.num_hidden_layers} layers, got {self.layer_types}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def gemma_layout(self) -> bool:
        """Scaled embeddings, (1 + w) norms and sandwich norms (GEMMA_FAMILIES)."""
        return self.family in GEMMA_FAMILIES

    def layer_sliding_window(self, index: int) -> int | None:
        """How far back layer ``index``'s queries see (None: every earlier key)."""
        if self.layer_types and self.layer_types[index] == "full_attention":
            return None
        return self.sliding_window

    def uses_local_rope(self, index: int) -> bool:
        """Does layer ``index`` rotate by ``rope_local`` (Gemma 3's sliding layers)?"""
        return self.rope_local is not None and self.layer_sliding_window(index) is not None

    def attention_variations(self) -> list[str]:
        """What this model's attention does beyond softmax(q k / sqrt(head_dim)) under one
        rule for every layer (what a compression policy scoring attention must know)."""
        variations = []
        if len({self.layer_sliding_window(index) for index in range(self.num_hidden_layers)}) > 1:
            variations.append("alternating sliding-window and global layers")
        if self.attn_logit_softcapping:
            variations.append("attention logit soft-capping")
        if self.query_pre_attn_scalar and self.query_pre_attn_scalar != self.head_dim:
            variations.append("query_pre_attn_scalar")
        return variations

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def is_sparse_layer(self, index: int) -> bool:
        """Does layer ``index`` route its tokens to experts (else a dense MLP)?"""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def cap_context(self, max_model_len: int) -> None:
        """Serve sequences of at most ``max_model_len`` tokens (0: as long as the model
        takes); raises ValueError past what the model takes."""
        if max_model_len > self.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {self.max_position_embeddings}")
        if max_model_len:
            self.max_position_embeddings = max_model_len

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V for one token in one layer."""
        return 2 * self.num_key_value_heads * self.head_dim * element_size

    def num_parameters(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.gemma_layout:  # pre- and post-feed-forward norms
            per_layer += 2 * h
        sparse = sum(self.is_sparse_layer(index) for index in range(layers))
        feed_forward = ((layers - sparse) * 3 * h * i
                        + sparse * self.num_experts * (3 * h * self.expert_intermediate_size + h))
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + feed_forward + embeddings + h

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` that both baton and transformers read."""
        rope = dict(self.rope)
        theta = rope.pop("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", "default")
        data = {
            "architectures": [self.architecture],
            "model_type": MODEL_TYPES.get(self.family, self.family),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.checkpoint_max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": theta,
            "rope_scaling": None if rope_type == "default" else rope,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.family in ("llama", "qwen3", "qwen3_moe"):
            data["attention_bias"] = self.attention_bias
        if self.family in SLIDING_WINDOW_FAMILIES:
            data["sliding_window"] = self.sliding_window
        if "partial_rotary_factor" in rope:  # where transformers reads it for every rope type
            data["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        if self.family == "phi3" and "original_max_position_embeddings" in rope:
            data["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
        if self.gemma_layout:
            del data["hidden_act"]
            data.update(_gemma_hf_dict(self))
        if self.family == "mixtral":
            data.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok)
        if self.family == "qwen3_moe":
            data.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                        moe_intermediate_size=self.expert_intermediate_size,
                        norm_topk_prob=self.norm_topk_prob,
                        decoder_sparse_step=self.decoder_sparse_step,
                        mlp_only_layers=list(self.mlp_only_layers))
        return data

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architectures = data.get("architectures") or []
        if not architectures:
            raise CheckpointError(source, "architectures", "is missing")
        architecture = architectures[0]
        if architecture not in ARCHITECTURES:
            raise CheckpointError(source, "architectures",
                                  f"{architecture!r} is not supported; supported: {sorted(ARCHITECTURES)}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        for name in required:
            if not isinstance(data.get(name), int):
                raise CheckpointError(source, name, f"must be an integer, got {data.get(name)!r}")
        family = ARCHITECTURES[architecture]
        rope_local = None
        if family == "gemma3":
            rope, rope_local = _gemma3_ropes(data)
        else:
            rope = dict(data.get("rope_parameters") or {})
        if not rope:
            rope = dict(data.get("rope_scaling") or {})
            rope["rope_theta"] = data.get("rope_theta", 10000.0)
        if "partial_rotary_factor" in data:  # Phi-3 and others keep it beside the rope dict
            rope.setdefault("partial_rotary_factor", data["partial_rotary_factor"])
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        if family == "phi3" and rope["rope_type"] in ("su", "yarn"):  # Phi-3's older names
            rope["rope_type"] = "longrope"
        if rope["rope_type"] not in ROPE_TYPES:
            raise CheckpointError(source, "rope_scaling.rope_type",
                                  f"{rope['rope_type']!r} is not supported; supported: {ROPE_TYPES}")
        if rope["rope_type"] in ROPE_TYPES_WITH_ORIGINAL_CONTEXT:
            # as transformers standardises it: Phi-3 keeps it beside rope_scaling, not in it
            rope["original_max_position_embeddings"] = (
                data.get("original_max_position_embeddings")
                or rope.get("original_max_position_embeddings")
                or (4096 if family == "phi3" else data.get("max_position_embeddings", 2048)))
        sliding = None
        if family in SLIDING_WINDOW_FAMILIES:
            sliding = data.get("sliding_window")
        if family in GEMMA_FAMILIES:  # for the sliding layers of layer_types
            sliding = data.get("sliding_window", 4096)
        if family in GEMMA_FAMILIES and data.get("use_bidirectional_attention"):
            raise CheckpointError(source, "use_bidirectional_attention",
                                  f"{architecture}'s bidirectional attention is not supported")
        if family in ("qwen2", "qwen3", "qwen3_moe") and data.get("use_sliding_window"):
            raise CheckpointError(source, "use_sliding_window",
                                  f"{architecture}'s sliding-window attention is not supported")
        try:
            return cls(
                vocab_size=data["vocab_size"],
                hidden_size=data["hidden_size"],
                intermediate_size=data["intermediate_size"],
                num_hidden_layers=data["num_hidden_layers"],
                num_attention_heads=data["num_attention_heads"],
                num_key_value_heads=data.get("num_key_value_heads") or data["num_attention_heads"],
                head_dim=data.get("head_dim") or 0,
                rms_norm_eps=data.get("rms_norm_eps", 1e-6),
                max_position_embeddings=data.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", family in GEMMA_FAMILIES)),
                architecture=architecture,
                attention_bias=True if family == "qwen2" else bool(data.get("attention_bias", False)),
                qk_norm=family in QK_NORM_FAMILIES,
                **_experts(family, data),
                sliding_window=sliding,
                rope=rope,
                rope_local=rope_local,
                **_gemma(family, data),
                bos_token_id=data.get("bos_token_id"),
                eos_token_id=data.get("eos_token_id"),
            )
        except ValueError as e:
            raise CheckpointError(source, "config", str(e)) from e

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        config = cls.from_hf_dict(read_config_json(path), str(path))
        # generation_config.json's end-of-sequence ids join config.json's (a chat model's
        # end-of-turn token is often listed there alone)
        extra = [i for i in GenerationConfig.from_dir(path.parent).eos_token_ids
                 if i not in config.eos_token_ids]
        if extra:
            config.eos_token_id = config.eos_token_ids + extra
        return config

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_config_json(path: Path) -> dict[str, Any]:
    """The contents of a checkpoint's ``config.json`` (CheckpointError if missing or not JSON)."""
    if not path.is_file():
        raise CheckpointError(str(path), "config.json", "file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(str(path), "config.json", f"is not valid JSON: {e}") from e


def _experts(family: str, data: dict[str, Any]) -> dict[str, Any]:
    """A sparse family's routing, as its config.json names it."""
    if family == "mixtral":  # always renormalised
        return {"num_experts": data.get("num_local_experts", 8),
                "num_experts_per_tok": data.get("num_experts_per_tok", 2)}
    if family == "qwen3_moe":
        # transformers 5 writes num_local_experts (earlier releases, num_experts)
        return {"num_experts": data.get("num_experts") or data.get("num_local_experts") or 0,
                "num_experts_per_tok": data.get("num_experts_per_tok", 0),
                "moe_intermediate_size": data.get("moe_intermediate_size", 0),
                "norm_topk_prob": bool(data.get("norm_topk_prob", False)),
                "decoder_sparse_step": data.get("decoder_sparse_step", 1) or 1,
                "mlp_only_layers": list(data.get("mlp_only_layers") or [])}
    return {}


def _gemma(family: str, data: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3's attention and MLP, as their config.json names them (transformers' defaults
    where a key is missing)."""
    if family not in GEMMA_FAMILIES:
        return {"hidden_act": data.get("hidden_act") or "silu"}
    # Gemma 2 alternates sliding and global layers; Gemma 3 has one global layer in every
    # sliding_window_pattern (6 when not given)
    pattern = 2 if family == "gemma2" else data.get("sliding_window_pattern") or 6
    layer_types = data.get("layer_types") or [
        "sliding_attention" if (index + 1) % pattern else "full_attention"
        for index in range(data["num_hidden_layers"])]
    capped = family == "gemma2"
    return {"hidden_act": data.get("hidden_activation") or data.get("hidden_act") or "gelu_pytorch_tanh",
            "query_pre_attn_scalar": data.get("query_pre_attn_scalar", 256),
            "attn_logit_softcapping": data.get("attn_logit_softcapping", 50.0 if capped else None),
            "final_logit_softcapping": data.get("final_logit_softcapping", 30.0 if capped else None),
            "layer_types": list(layer_types)}


def _gemma3_ropes(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global layers' rope, sliding layers' rope): nested by layer type in transformers 5's
    rope_parameters, else rope_theta with rope_scaling, and rope_local_base_freq."""
    nested = data.get("rope_parameters") or {}
    if "full_attention" in nested:
        return dict(nested["full_attention"]), dict(nested.get("sliding_attention") or {})
    rope = {**(data.get("rope_scaling") or {}), "rope_theta": data.get("rope_theta", 1_000_000.0)}
    local = {"rope_type": "default", "rope_theta": data.get("rope_local_base_freq", 10_000.0)}
    return rope, local


def _gemma_hf_dict(config: ModelConfig) -> dict[str, Any]:
    """The keys of a Gemma config.json that ``_gemma`` and ``_gemma3_ropes`` read."""
    data = {"hidden_activation": config.hidden_act,
            "query_pre_attn_scalar": config.query_pre_attn_scalar,
            "attn_logit_softcapping": config.attn_logit_softcapping,
            "final_logit_softcapping": config.final_logit_softcapping,
            "sliding_window": config.sliding_window, "layer_types": list(config.layer_types)}
    if config.rope_local is not None:
        data["rope_local_base_freq"] = config.rope_local.get("rope_theta", 10_000.0)
    return data
