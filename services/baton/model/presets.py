"""Named model configurations for benchmarks and tests, and a random-weight builder.

``random-50m`` is the ~50M-parameter Llama-style config every benchmark uses
beside the shipped model, so that figures from different reports compare;
``random-100m`` is the peer benchmark's (vLLM loads it from the same directory);
``random-1b`` has Llama 3.2 1B's shape, for the GPU benchmarks.
"""

from __future__ import annotations

import torch

from baton.model.config import ModelConfig
from baton.model.llama import CausalLM

PRESETS: dict[str, ModelConfig] = {
    # 56M parameters: 8 layers of 512 with 8 query and 4 KV heads of 64, a 32k vocabulary.
    "random-50m": ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                              num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                              max_position_embeddings=16384, rope={"rope_type": "default",
                                                                   "rope_theta": 500000.0}),
    # 96M parameters: 12 layers of 768 with 12 query and 4 KV heads of 64, the shipped model's
    # 4096-token vocabulary (so its tokenizer serves both): the peer benchmark's larger model.
    "random-100m": ModelConfig(vocab_size=4096, hidden_size=768, intermediate_size=2560,
                               num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                               max_position_embeddings=2048),
    # 1.24B parameters: Llama 3.2 1B's shape (16 layers of 2048, 32 query and 8 KV heads of 64,
    # a 128k vocabulary, the embedding tied to the output projection).
    "random-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                             num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192,
                             tie_word_embeddings=True,
                             rope={"rope_type": "default", "rope_theta": 500000.0}),
}


def random_model(config: ModelConfig | str, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", draw_on_device: bool = False) -> CausalLM:
    """A model with deterministic random weights (std 0.02, as Llama initialises).

    ``draw_on_device``: the weights are drawn where they will live, by ``device``'s own
    generator (seconds for a billion parameters on a GPU, where drawing them on the CPU and
    moving them takes minutes); the same seed then gives other values than the CPU's draw."""
    if isinstance(config, str):
        config = PRESETS[config]
    if draw_on_device:
        with torch.device("meta"):
            model = CausalLM(config)
        model.to_empty(device=device)
        if config.tie_word_embeddings:  # to_empty gave each module a parameter of its own
            model.lm_head.weight = model.model.embed_tokens.weight
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.fill_(1.0)
                else:
                    parameter.normal_(0.0, 0.02, generator=generator)
        return model.to(dtype=dtype).eval().fuse_projections()
    generator = torch.Generator().manual_seed(seed)
    model = CausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model.to(device=device, dtype=dtype).eval().fuse_projections()
