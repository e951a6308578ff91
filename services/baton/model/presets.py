"""Named model configurations for benchmarks and tests, and a random-weight builder.

``random-50m`` is the ~50M-parameter Llama-style config every benchmark uses
beside the shipped model, so that figures from different reports compare;
``random-100m`` is the peer benchmark's (vLLM loads it from the same directory).
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
}


def random_model(config: ModelConfig | str, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> CausalLM:
    """A model with deterministic random weights (std 0.02, as Llama initialises)."""
    if isinstance(config, str):
        config = PRESETS[config]
    generator = torch.Generator().manual_seed(seed)
    model = CausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model.to(device=device, dtype=dtype).eval().fuse_projections()
