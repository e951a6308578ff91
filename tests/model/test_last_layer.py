"""The last layer runs for the rows whose output is read, and the MLP goes through a long
batch in blocks of rows: both give the numbers of the plain forward."""

from __future__ import annotations

import torch
from baton.kv import DenseKV
from baton.model import CausalLM, layers
from baton.model.forward_batch import Segment
from hf_reference import tiny_config

LENGTHS = (13, 9, 17)  # three sequences' chunks in one flat batch


def _model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(tiny_config("llama2", num_key_value_heads=2)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.05)
    return model.fuse_projections()


def _forward(model: CausalLM, rows: list[int] | None, observer=None):
    """One forward over three fresh sequences; returns (hidden of ``rows``, their caches)."""
    generator = torch.Generator().manual_seed(5)
    token_ids = torch.randint(0, model.config.vocab_size, (sum(LENGTHS),), generator=generator)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    caches = [DenseKV(model.config.num_hidden_layers) for _ in LENGTHS]
    segments = [Segment(n, kv, observer if i == 0 else None) for i, (n, kv) in enumerate(zip(LENGTHS, caches))]
    hidden = model(token_ids, positions, segments, None if rows is None else torch.tensor(rows))
    return hidden, caches


def _full_forward_rows(model: CausalLM, rows: list[int]) -> torch.Tensor:
    """The reference: every row wanted, so every row goes through every layer."""
    return _forward(model, list(range(sum(LENGTHS))))[0][rows]


def test_wanted_rows_anywhere_in_the_batch_get_the_plain_forward_s_hidden_states():
    model = _model()
    for rows in ([12, 21, 38], [38], [5, 30, 12], [0, 1, 2, 20], list(range(sum(LENGTHS)))):
        hidden, _ = _forward(model, rows)
        torch.testing.assert_close(hidden, _full_forward_rows(model, rows), rtol=0, atol=1e-6)


def test_the_last_layer_stores_every_row_s_keys_and_values_when_no_row_is_wanted():
    model = _model()
    last = model.config.num_hidden_layers - 1
    hidden, narrowed = _forward(model, None)
    assert hidden.shape[0] == 0
    _, full = _forward(model, list(range(sum(LENGTHS))))
    for a, b in zip(narrowed, full):
        assert a.layers[last].num_tokens == b.layers[last].num_tokens
        torch.testing.assert_close(a.layers[last].k, b.layers[last].k, rtol=0, atol=0)
        torch.testing.assert_close(a.layers[last].v, b.layers[last].v, rtol=0, atol=0)


def test_an_observed_segment_sees_every_row_of_every_layer_and_the_rows_are_still_narrowed():
    model = _model()
    seen: dict[int, int] = {}

    class Counting:
        def observe(self, layer, q, query_positions, k, key_positions) -> None:
            seen[layer] = q.shape[0]

    rows = [LENGTHS[0] - 1, sum(LENGTHS) - 1]
    hidden, _ = _forward(model, rows, Counting())
    assert seen == dict.fromkeys(range(model.config.num_hidden_layers), LENGTHS[0])
    torch.testing.assert_close(hidden, _full_forward_rows(model, rows), rtol=0, atol=1e-6)


def test_the_mlp_in_blocks_of_rows_equals_the_mlp_at_once(monkeypatch):
    mlp = _model().model.layers[0].mlp
    x = torch.randn(1000, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(1))
    whole = mlp(x)
    assert mlp.block_rows(x) >= x.shape[0]
    monkeypatch.setattr(layers, "MLP_MIN_BLOCK_ROWS", 1)
    monkeypatch.setattr(layers, "MLP_BLOCK_BYTES", 300 * 2 * mlp.gate_proj.out_features * x.element_size())
    assert mlp.block_rows(x) == 300  # four blocks, the last one short
    torch.testing.assert_close(mlp(x), whole, rtol=0, atol=1e-6)
