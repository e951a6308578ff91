"""Checkpoint loading: sharded weights, and errors that name the file and the field."""

from __future__ import annotations

import json

import pytest
import torch
from baton.kv import DenseKV
from baton.model import CheckpointError, load_checkpoint, prefill
from hf_reference import save_random_hf_model, tiny_config
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    save_random_hf_model(tiny_config("llama2"), directory)
    return directory


def copy_checkpoint(source, target):
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def test_sharded_checkpoint_loads_the_same_weights(checkpoint, tmp_path):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    target = tmp_path / "sharded"
    target.mkdir()
    (target / "config.json").write_text((checkpoint / "config.json").read_text())
    weight_map = {}
    for shard, shard_names in halves.items():
        save_file({n: tensors[n] for n in shard_names}, str(target / shard))
        weight_map.update({n: shard for n in shard_names})
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    single = load_checkpoint(checkpoint, dtype="float32", device="cpu", with_tokenizer=False)
    sharded = load_checkpoint(target, dtype="float32", device="cpu", with_tokenizer=False)
    ids = torch.arange(10)
    layers = single.config.num_hidden_layers
    assert torch.equal(prefill(single.model, ids, ids, DenseKV(layers)),
                       prefill(sharded.model, ids, ids, DenseKV(layers)))


def test_unknown_architecture_names_file_and_field(checkpoint, tmp_path):
    target = copy_checkpoint(checkpoint, tmp_path / "c")
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: architectures 'GPT2LMHeadModel'"):
        load_checkpoint(target, with_tokenizer=False)


def test_missing_weight_names_it(checkpoint, tmp_path):
    target = copy_checkpoint(checkpoint, tmp_path / "c")
    tensors = load_file(str(target / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: model\.layers\.1\.mlp\.up_proj"
                                              r"\.weight is missing"):
        load_checkpoint(target, with_tokenizer=False)


def test_wrong_shape_names_weight_and_shapes(checkpoint, tmp_path):
    target = copy_checkpoint(checkpoint, tmp_path / "c")
    tensors = load_file(str(target / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(7,\), expected \(64,\)"):
        load_checkpoint(target, with_tokenizer=False)


def test_missing_tokenizer_names_the_file(checkpoint):
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: tokenizer\.json file not found"):
        load_checkpoint(checkpoint)


def test_missing_config_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match="config.json file not found"):
        load_checkpoint(tmp_path, with_tokenizer=False)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    with pytest.raises(CheckpointError, match="model.safetensors file not found"):
        load_checkpoint(tmp_path, with_tokenizer=False)


def test_required_config_field_is_named(tmp_path):
    data = tiny_config().to_hf_dict()
    del data["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="hidden_size must be an integer"):
        load_checkpoint(tmp_path, with_tokenizer=False)


@pytest.mark.parametrize(("bf16_instructions", "amx", "expected"),
                         [(True, False, torch.bfloat16), (False, True, torch.bfloat16),
                          (False, False, torch.float32)])
def test_auto_dtype_follows_the_cpus_instructions_not_a_timing(monkeypatch, bf16_instructions, amx,
                                                               expected):
    """Every process of a deployment must resolve ``auto`` alike (a chain's KV reaches the
    decode pods in its dtype): on a CPU it is read off the instruction set, so a process
    that starts while the others load picks what they pick."""
    from baton.model.loader import resolve_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_instructions)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
