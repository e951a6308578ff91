"""Quantized checkpoints load as the model their dequantized weights make, or are refused.

Each checkpoint is made here from a random transformers model (``quantized_checkpoints``);
the reference is that model holding the dequantized weights, unquantized. baton's logits
must match it within 1e-4 in fp32 over prefill, chunked prefill and batched decode, and
its greedy tokens must be the reference's.
"""

from __future__ import annotations

import json

import pytest
import torch
from baton.kv import KVPool
from baton.model import CheckpointError, decode_step, load_checkpoint, prefill
from hf_reference import max_error, reference_logits, run_scenario, sequences
from quantized_checkpoints import Layout, save_quantized_checkpoint
from safetensors.torch import load_file, save_file

TOLERANCE = 1e-4
SUPPORTED = r"supported: \['awq', 'compressed-tensors', 'fp8', 'gptq'\]"


def compressed_tensors(strategy: str, block: list[int] | None = None,
                       ignore: tuple[str, ...] = ("lm_head",), form: str = "float-quantized") -> dict:
    """A quantization_config as llm-compressor writes it for FP8 weights."""
    weights = {"dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": strategy,
               "symmetric": True, "type": "float", "group_size": None, "block_structure": block}
    activations = {"dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": "tensor",
                   "symmetric": True, "type": "float"}
    return {"quant_method": "compressed-tensors", "format": form, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None}},
            "ignore": list(ignore), "kv_cache_scheme": None, "global_compression_ratio": None}


def fine_grained_fp8(block: list[int] | None, unquantized: tuple[str, ...] = ()) -> dict:
    """As DeepSeek-V3's and Qwen3-FP8's config.json write it."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": block, "modules_to_not_convert": list(unquantized) or None}


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": None}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
        "checkpoint_format": "gptq", "damp_percent": 0.01, "static_groups": False,
        "true_sequential": True}
LAYER0_DOWN = r"re:.*layers\.0\.mlp\.down_proj$"
LAYER1_O = "model.layers.1.self_attn.o_proj"

CASES = {
    # per-tensor bf16 scales, with the static activation scales baton does not read
    "llama-ct-fp8-tensor": ("llama3", Layout(compressed_tensors("tensor"), scale_dtype=torch.bfloat16,
                                             extra={"input_scale": torch.tensor([0.02])})),
    # per-channel fp32 scales; layer 0's down_proj left unquantized by ignore
    "llama-ct-fp8-channel": ("llama3", Layout(compressed_tensors("channel", ignore=("lm_head", LAYER0_DOWN)),
                                              unquantized=(LAYER0_DOWN,))),
    "qwen3-ct-fp8-block": ("qwen3", Layout(compressed_tensors("block", [32, 32], form="naive-quantized"),
                                           scale_dtype=torch.bfloat16)),
    # DeepSeek's 128 x 128 tiles, partial over these small matrices; one layer unquantized
    "qwen3-fp8-block128": ("qwen3", Layout(fine_grained_fp8([128, 128], ("lm_head", LAYER1_O)),
                                           unquantized=(LAYER1_O,))),
    "llama-fp8-block32": ("llama2", Layout(fine_grained_fp8([32, 32]))),
    "llama-fp8-tensor": ("llama2", Layout(fine_grained_fp8(None))),
    # experts quantized, the router not (as Qwen3-MoE-FP8 checkpoints store it)
    "qwen3_moe-fp8-block128": ("qwen3_moe", Layout(fine_grained_fp8([128, 128]))),
    "llama-awq": ("llama3", Layout(AWQ)),
    "qwen3-awq": ("qwen3", Layout(AWQ)),
    "llama-gptq": ("llama3", Layout(GPTQ)),
    "qwen3-gptq": ("qwen3", Layout(GPTQ)),
    # q/k/v and gate/up fused in the checkpoint: dequantized whole, then cut into projections
    "phi3-gptq": ("phi3", Layout(GPTQ)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    variant, layout = CASES[request.param]
    directory = tmp_path_factory.mktemp("quantized") / request.param
    reference = save_quantized_checkpoint(variant, layout, directory, seed=request.param_index)
    return reference, directory


def test_logits_equal_the_dequantized_model(pair):
    reference, directory = pair
    ours = load_checkpoint(directory, dtype="float32", device="cpu", with_tokenizer=False)
    token_sequences = sequences(ours.config.vocab_size)
    want = reference_logits(reference, token_sequences)
    assert max_error(run_scenario(ours, token_sequences), want) < TOLERANCE


def test_greedy_tokens_equal_the_dequantized_model(pair):
    reference, directory = pair
    ours = load_checkpoint(directory, dtype="float32", device="cpu", with_tokenizer=False)
    config = ours.config
    prompt = torch.randint(0, config.vocab_size, (13,), generator=torch.Generator().manual_seed(5))
    kv = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                block_size=4, num_blocks=64).view("greedy")
    tokens = [int(prefill(ours.model, prompt, torch.arange(len(prompt)), kv).argmax())]
    for _ in range(11):
        position = torch.tensor([len(prompt) + len(tokens) - 1])
        tokens.append(int(decode_step(ours.model, torch.tensor(tokens[-1:]), position, [kv])[0].argmax()))
    with torch.no_grad():
        generated = reference.generate(prompt[None], max_new_tokens=12, do_sample=False,
                                       attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert tokens == generated[0, len(prompt):].tolist()


# --- refusals ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fp8") / "ckpt"
    save_quantized_checkpoint("llama2", Layout(compressed_tensors("channel")), directory)
    return directory


def copy_checkpoint(source, target, config_change=None, tensors_change=None):
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    if config_change:
        config_change(config)
    (target / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(source / "model.safetensors"))
    if tensors_change:
        tensors_change(tensors)
    save_file(tensors, str(target / "model.safetensors"))
    return target


def test_float8_weight_without_its_scale_is_refused(fp8_checkpoint, tmp_path):
    target = copy_checkpoint(fp8_checkpoint, tmp_path / "c",
                             tensors_change=lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is stored "
                                              r"as torch\.float8_e4m3fn without the scales "
                                              r".*compressed-tensors"):
        load_checkpoint(target, dtype="float32", device="cpu", with_tokenizer=False)


def test_float8_weights_without_a_quantization_config_are_refused(fp8_checkpoint, tmp_path):
    target = copy_checkpoint(fp8_checkpoint, tmp_path / "c",
                             config_change=lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight is stored as torch\.float8_e4m3fn "
                                              r"without the scales that give its values "
                                              r"\(quantization_config: none\)"):
        load_checkpoint(target, dtype="float32", device="cpu", with_tokenizer=False)


def test_an_ignored_layer_stored_in_float8_is_refused(fp8_checkpoint, tmp_path):
    def ignore_layer0_up(config):
        config["quantization_config"]["ignore"].append("model.layers.0.mlp.up_proj")

    target = copy_checkpoint(fp8_checkpoint, tmp_path / "c", config_change=ignore_layer0_up)
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.up_proj\.weight is stored as torch\.float8"):
        load_checkpoint(target, dtype="float32", device="cpu", with_tokenizer=False)


def test_scales_of_the_wrong_shape_are_refused(fp8_checkpoint, tmp_path):
    def cut(tensors):
        name = "model.layers.0.self_attn.k_proj.weight_scale"
        tensors[name] = tensors[name][:3].clone()

    target = copy_checkpoint(fp8_checkpoint, tmp_path / "c", tensors_change=cut)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has scales of shape \(3, 1\)"):
        load_checkpoint(target, dtype="float32", device="cpu", with_tokenizer=False)


REFUSED = {
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                     r"\.quant_method 'bitsandbytes' is not supported; " + SUPPORTED),
    "mxfp4": ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]},
              r"\.quant_method 'mxfp4' is not supported; " + SUPPORTED),
    "gguf": ({"quant_method": "gguf"}, r"\.quant_method 'gguf' is not supported; " + SUPPORTED),
    "no-method": ({"bits": 4}, r"\.quant_method None is not supported; " + SUPPORTED),
    "gptq-8bit": ({**GPTQ, "bits": 8}, r"\.bits 8 of gptq is not supported; supported: 4"),
    "gptq-marlin": ({**GPTQ, "checkpoint_format": "marlin"},
                    r"\.checkpoint_format 'marlin' is not supported"),
    "awq-gemv": ({**AWQ, "version": "gemv"}, r" awq version 'gemv'.* is not supported"),
    "ct-int4-packed": ({**compressed_tensors("group"), "format": "pack-quantized"},
                       r"\.format \['pack-quantized'\] of compressed-tensors is not supported"),
    "ct-int8": ({**compressed_tensors("channel", form="int-quantized")}, r"\.format \['int-quantized'\]"),
    "ct-transform": ({**compressed_tensors("channel"), "transform_config": {"config_groups": {}}},
                     r"\.transform_config is not supported"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_quantizations_are_refused_naming_the_method(fp8_checkpoint, tmp_path, name):
    quantization, message = REFUSED[name]
    target = copy_checkpoint(fp8_checkpoint, tmp_path / "c",
                             config_change=lambda c: c.update(quantization_config=quantization))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config" + message):
        load_checkpoint(target, dtype="float32", device="cpu", with_tokenizer=False)
