"""The training forward is the inference model: same logits as ``CausalLM.forward``."""

from __future__ import annotations

import torch
from baton.kv.dense import DenseKV
from baton.model.forward_batch import Segment
from baton.model.llama import CausalLM
from baton.train.forward import hidden_states, next_token_loss
from baton.train.trainer import initialize
from hf_reference import tiny_config


def test_training_forward_equals_inference_forward_with_gqa():
    torch.manual_seed(0)
    model = CausalLM(tiny_config("llama3", tie_word_embeddings=True)).eval()  # 4 heads over 2 KV heads
    initialize(model)
    token_ids = torch.randint(0, model.config.vocab_size, (3, 40))
    with torch.no_grad():
        batched = hidden_states(model, token_ids)  # [3, 40, hidden]
    for row in range(token_ids.shape[0]):
        kv = DenseKV(model.config.num_hidden_layers)
        alone = model(token_ids[row], torch.arange(40), [Segment(40, kv)], torch.arange(40))
        torch.testing.assert_close(batched[row], alone, atol=1e-5, rtol=1e-5)


def test_loss_is_cross_entropy_of_the_next_token_and_has_gradients():
    torch.manual_seed(0)
    model = CausalLM(tiny_config("llama2"))
    windows = torch.randint(0, model.config.vocab_size, (2, 17))
    loss = next_token_loss(model, windows)
    logits = model.lm_head(hidden_states(model, windows[:, :-1]))
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 windows[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
