"""PyramidInfer refuses, by name, a model whose attention it cannot score (Gemma's per-layer
windows, soft-capping and query scale), at start and on a request that turns it on."""

from __future__ import annotations

import pytest
from baton.config import PyramidConfig
from baton.pyramid import compressor_factory, engine_compressor_factory
from baton.sampling.params import CompressionParams, SamplingParams
from hf_reference import tiny_config


def test_gemma_is_refused_at_start_naming_the_family_and_the_features():
    with pytest.raises(ValueError, match="Gemma2ForCausalLM's alternating sliding-window and global "
                                         "layers, attention logit soft-capping, query_pre_attn_scalar"):
        engine_compressor_factory(PyramidConfig(enabled=True), tiny_config("gemma2"))
    with pytest.raises(ValueError, match="Gemma3ForCausalLM's alternating sliding-window"):
        compressor_factory(PyramidConfig(enabled=True), tiny_config("gemma3"))


def test_a_request_that_turns_compression_on_is_refused_and_one_that_does_not_runs():
    factory = engine_compressor_factory(PyramidConfig(enabled=False), tiny_config("gemma3"))
    assert factory([1, 2, 3], SamplingParams()) is None
    with pytest.raises(ValueError, match="PyramidInfer compression does not support Gemma3ForCausalLM"):
        factory([1, 2, 3], SamplingParams(compression=CompressionParams(enabled=True)))


def test_one_window_for_every_layer_is_compressed_as_before():
    for variant in ("mistral", "phi3"):
        assert engine_compressor_factory(PyramidConfig(enabled=True), tiny_config(variant)) is not None
