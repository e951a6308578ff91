"""Checkpoints whose family fuses projections (Phi-3's qkv_proj, gate_up_proj): baton's
saved checkpoint stacks them as transformers does, loads back equal, and a missing fused
tensor is named."""

from __future__ import annotations

import pytest
import torch
from baton.model import CheckpointError, load_checkpoint, save_checkpoint
from baton.model.presets import random_model
from baton.model.weight_names import TensorSlice, checkpoint_source
from hf_reference import tiny_config
from safetensors import safe_open
from safetensors.torch import save_file


def test_each_projection_is_its_rows_of_the_fused_tensor():
    config = tiny_config("phi3", num_attention_heads=4, num_key_value_heads=2)  # head_dim 16
    layer = "model.layers.2"
    assert checkpoint_source(config, f"{layer}.self_attn.q_proj.weight") == \
        TensorSlice(f"{layer}.self_attn.qkv_proj.weight", 0, 64)
    assert checkpoint_source(config, f"{layer}.self_attn.v_proj.weight") == \
        TensorSlice(f"{layer}.self_attn.qkv_proj.weight", 96, 128)
    assert checkpoint_source(config, f"{layer}.mlp.up_proj.weight") == \
        TensorSlice(f"{layer}.mlp.gate_up_proj.weight", 160, 320)
    assert checkpoint_source(config, f"{layer}.self_attn.o_proj.weight") == \
        TensorSlice(f"{layer}.self_attn.o_proj.weight")
    llama = tiny_config("llama2")
    assert checkpoint_source(llama, f"{layer}.self_attn.q_proj.weight") == \
        TensorSlice(f"{layer}.self_attn.q_proj.weight")


def test_a_phi3_checkpoint_round_trips_fused_and_a_missing_fused_tensor_is_named(tmp_path):
    model = random_model(tiny_config("phi3"), seed=1)
    save_checkpoint(model, tmp_path, dtype=torch.float32)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any("q_proj" in name or "gate_proj" in name for name in names)
    loaded = load_checkpoint(tmp_path, dtype="float32", device="cpu", with_tokenizer=False).model
    for (name, want), got in zip(model.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(got, want), name

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    del tensors["model.layers.1.mlp.gate_up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.gate_up_proj.weight.*is missing"):
        load_checkpoint(tmp_path, dtype="float32", device="cpu", with_tokenizer=False)
