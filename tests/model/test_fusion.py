"""Fused q/k/v and gate/up projections: same numbers, same parameter names, weights shared."""

from __future__ import annotations

import torch
from baton.kv import DenseKV
from baton.model import CausalLM, load_checkpoint, prefill, save_checkpoint
from hf_reference import tiny_config


def _model(variant: str, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(tiny_config(variant, num_attention_heads=4, num_key_value_heads=2)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.05)
    return model


def _logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    return prefill(model, ids, torch.arange(ids.shape[0]), DenseKV(model.config.num_hidden_layers))


def test_fused_equals_unfused_with_and_without_biases():
    ids = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(3))
    for variant in ("llama2", "qwen2"):  # qwen2 has q/k/v biases
        model = _model(variant)
        assert (model.model.layers[0].self_attn.q_proj.bias is not None) == (variant == "qwen2")
        before = _logits(model, ids)
        names = sorted(name for name, _ in model.named_parameters())
        model.fuse_projections()
        assert model.model.layers[0].self_attn.qkv is not None
        assert sorted(name for name, _ in model.named_parameters()) == names
        assert (_logits(model, ids) - before).abs().max() < 1e-5


def test_loading_weights_after_fusion_writes_through_to_the_fused_matrix():
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(4))
    source, target = _model("llama2", seed=1), _model("llama2", seed=2).fuse_projections()
    target.load_state_dict(source.state_dict())
    assert (_logits(target, ids) - _logits(source, ids)).abs().max() < 1e-5


def test_a_fused_model_saves_and_loads(tmp_path):
    model = _model("qwen2").fuse_projections()
    save_checkpoint(model, tmp_path, dtype=torch.float32)
    loaded = load_checkpoint(tmp_path, dtype="float32", device="cpu", with_tokenizer=False)
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(5))
    assert (_logits(loaded.model, ids) - _logits(model, ids)).abs().max() < 1e-6


def test_a_fused_model_moved_to_another_dtype_fuses_again():
    # What `.to(device)` does to a fused model, shown with a dtype change (CPU has one device):
    # the layers get new tensors, and the next forward fuses those rather than the stale matrix.
    ids = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(6))
    model = _model("qwen2").fuse_projections()
    expected = _logits(model, ids).double()
    moved = model.to(torch.float64)
    qkv = moved.model.layers[0].self_attn.qkv
    assert (_logits(moved, ids) - expected).abs().max() < 1e-5
    assert qkv.weight.dtype == torch.float64
    assert qkv.weight.data_ptr() == moved.model.layers[0].self_attn.q_proj.weight.data_ptr()
