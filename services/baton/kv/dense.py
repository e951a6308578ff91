"""A plain in-memory KV cache of one sequence: a list of tensors per layer.

Used where no pool is needed: a single-process prefill, a chain rank's
working cache, tests and references. ``layers`` is the small result type
handed across module boundaries (to the pool, to the wire codec).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerKV:
    """One layer's cache of one sequence. k, v: [S, Hkv, D]; positions: [S] (original positions)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.k.shape[0]

    def store_into(self, pool, seq_id: str, layer: int) -> None:
        """Into the pool's blocks for this layer (``baton.kv.landing.StorableLayer``)."""
        pool.append(seq_id, layer, self.k, self.v, self.positions)


class DenseKV:
    """``SequenceKV`` backed by growing tensors (concatenation on every extend)."""

    def __init__(self, num_layers: int, layers: list[LayerKV] | None = None) -> None:
        self.layers: list[LayerKV | None] = list(layers) if layers is not None else [None] * num_layers
        assert len(self.layers) == num_layers, "one LayerKV per layer"

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        current = self.layers[layer]
        if current is None:
            current = LayerKV(k, v, positions)
        else:
            current = LayerKV(torch.cat([current.k, k]), torch.cat([current.v, v]),
                              torch.cat([current.positions, positions]))
        self.layers[layer] = current
        return current.k, current.v, current.positions

    def lengths(self) -> list[int]:
        return [0 if layer is None else layer.num_tokens for layer in self.layers]

    def complete_layers(self) -> list[LayerKV]:
        assert all(layer is not None for layer in self.layers), "every layer must be filled"
        return list(self.layers)  # type: ignore[arg-type]
