"""The KV wire codec: pyramid-shaped caches arrive bit-exact, and bad streams never become KV."""

from __future__ import annotations

import dataclasses
import sys
import zlib

import pytest
import torch
import xxhash
from baton.kv import KVPool
from baton.kv.dense import LayerKV
from baton.kv.landing import LandedLayer, Landing
from baton.transfer.assembler import KVAssembler
from baton.transfer.codec import (
    CHUNK_BYTES,
    KVDataLoss,
    KVIncompatible,
    KVMalformed,
    KVSpec,
    encode_kv,
)
from baton.transfer.received import ReceivedLayer

LAYERS, HEADS, DIM, MAX_TOKENS = 4, 2, 8, 512
SPEC = KVSpec("tiny", "rev-1", "float32", LAYERS, HEADS, DIM, MAX_TOKENS)


def pyramid_cache(dtype: torch.dtype = torch.float32, prompt: int = 300) -> list[LayerKV]:
    """Fewer tokens in deeper layers, each layer keeping a different subset of positions."""
    generator = torch.Generator().manual_seed(0)
    layers = []
    for layer in range(LAYERS):
        keep = prompt * (LAYERS - layer) // LAYERS
        positions = torch.randperm(prompt, generator=generator)[:keep].sort().values
        layers.append(LayerKV(torch.randn(keep, HEADS, DIM, generator=generator).to(dtype),
                              torch.randn(keep, HEADS, DIM, generator=generator).to(dtype),
                              positions))
    return layers


def receive(header, chunks, spec=SPEC, checksum=None) -> list[LayerKV]:
    """Assemble ``chunks``; the sender's checksum is theirs unless given."""
    chunks = list(chunks)
    if checksum is None:
        payload = b"".join(chunks)
        checksum = (xxhash.xxh3_64_intdigest(payload) if header.checksum_algorithm == "xxh3-64"
                    else zlib.crc32(payload))
    with KVAssembler(header, spec) as assembler:
        for chunk in chunks:
            assembler.add(chunk)
        return assembler.finish(checksum)


def assert_same(sent: list[LayerKV], received: list[LayerKV]) -> None:
    assert len(sent) == len(received)
    for a, b in zip(sent, received):
        assert a.k.dtype == b.k.dtype and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        assert torch.equal(a.positions, b.positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_bytes", [CHUNK_BYTES, 1000, 7])
def test_pyramid_cache_round_trips_bit_exact(dtype, chunk_bytes):
    layers = pyramid_cache(dtype)
    encoded = encode_kv(layers, "req-1", "tiny", "rev-1")
    header = encoded.header
    assert header.layer_num_tokens == (300, 225, 150, 75)
    assert header.total_bytes == sum(8 * n + 2 * n * HEADS * DIM * layers[0].k.element_size()
                                     for n in header.layer_num_tokens)
    chunks = list(encoded.chunks(chunk_bytes))
    assert all(len(chunk) == chunk_bytes for chunk in chunks[:-1])
    spec = dataclasses.replace(SPEC, dtype=header.dtype)
    assert_same(layers, receive(header, chunks, spec))


@pytest.mark.parametrize("chunk_bytes", [CHUNK_BYTES, 1000, 7])
def test_received_cache_fits_the_pool(chunk_bytes):
    layers = pyramid_cache()
    encoded = encode_kv(layers, "req-1", "tiny", "rev-1")
    pool = KVPool(LAYERS, HEADS, DIM, block_size=16, num_blocks=64)
    # Leave a hole below another sequence's blocks: the cache's blocks are then two runs.
    pool.reserve("before", [40, 0, 0, 0])
    pool.reserve("after", [20, 20, 20, 20])
    pool.free("before")
    pool.store("req-1", receive(encoded.header, encoded.chunks(chunk_bytes)))
    assert pool._tables["req-1"][0].blocks[:4] == [0, 1, 2, 11]
    assert pool.lengths("req-1") == [300, 225, 150, 75]
    assert_same(layers, [pool.gather("req-1", layer) for layer in range(LAYERS)])


def test_received_keys_and_values_are_the_chunks_bytes_not_copies():
    layers = pyramid_cache()
    encoded = encode_kv(layers, "req-1", "tiny", "rev-1")
    chunks = list(encoded.chunks(1000))
    received = receive(encoded.header, chunks)
    for layer in received:
        assert isinstance(layer, ReceivedLayer)
        assert all(any(piece.obj is chunk for chunk in chunks)
                   for piece in (*layer.k_pieces, *layer.v_pieces))
    assert_same(layers, received)


def positions_first(layers: list[LayerKV]) -> bytes:
    """The payload as a sender of an earlier release lays it out."""
    payload = b"".join(layer.positions.numpy().tobytes() for layer in layers)
    return payload + b"".join(tensor.contiguous().numpy().tobytes()
                              for layer in layers for tensor in (layer.k, layer.v))


@pytest.mark.parametrize("layout", ["layer-major", "positions-first"])
@pytest.mark.parametrize("landed_after", [0, 5, 40])  # chunks that came before the landing
def test_a_cache_that_lands_in_the_pool_as_it_arrives_is_stored_exact(layout, landed_after):
    layers = pyramid_cache()
    encoded = encode_kv(layers, "req-1", "tiny", "rev-1")
    header = dataclasses.replace(encoded.header, layout=layout)
    payload = b"".join(encoded.chunks()) if layout == "layer-major" else positions_first(layers)
    chunks = [payload[offset:offset + 1000] for offset in range(0, len(payload), 1000)]
    assert landed_after < len(chunks)
    pool = KVPool(LAYERS, HEADS, DIM, block_size=16, num_blocks=64)
    pool.reserve("before", [40, 0, 0, 0])  # a hole below the landing's blocks, as in a busy pool
    pool.reserve("after", [20, 20, 20, 20])
    pool.free("before")
    free = pool.num_free_blocks
    landing = pool.land(list(header.layer_num_tokens))
    assert pool.num_free_blocks == free - sum(pool.blocks_for(n) for n in header.layer_num_tokens)
    with KVAssembler(header, SPEC) as assembler:
        for index, chunk in enumerate(chunks):
            if index == landed_after:
                assembler.land(landing)
            assembler.add(chunk)
        received = assembler.finish(xxhash.xxh3_64_intdigest(payload))
    assert all(isinstance(layer, LandedLayer) and layer.landing is landing for layer in received)
    pool.store("req-1", received)
    assert pool.lengths("req-1") == [300, 225, 150, 75]
    assert_same(layers, [pool.gather("req-1", layer) for layer in range(LAYERS)])
    pool.free("req-1")
    assert pool.num_free_blocks == free


def test_a_landing_that_is_given_back_returns_its_blocks():
    pool = KVPool(LAYERS, HEADS, DIM, block_size=16, num_blocks=64)
    landing = pool.land([300, 225, 150, 75])
    assert pool.num_free_blocks == 64 - 19 - 15 - 10 - 5
    with pytest.raises(ValueError, match="did not land"):
        pool.store("req-1", [LandedLayer(torch.arange(n), Landing([])) for n in (300, 225, 150, 75)])
    pool.free(landing)
    assert pool.num_free_blocks == 64


def test_a_received_cache_enters_a_pool_of_another_dtype_converted():
    layers = pyramid_cache()
    encoded = encode_kv(layers, "req-1", "tiny", "rev-1")
    pool = KVPool(LAYERS, HEADS, DIM, block_size=16, num_blocks=64, dtype=torch.bfloat16)
    pool.store("req-1", receive(encoded.header, encoded.chunks(1000)))
    for layer, stored in zip(layers, (pool.gather("req-1", index) for index in range(LAYERS))):
        assert torch.equal(stored.k, layer.k.to(torch.bfloat16))
        assert torch.equal(stored.positions, layer.positions)


def test_other_byte_order_is_swapped():
    layers = pyramid_cache(torch.float16)
    other = "big" if sys.byteorder == "little" else "little"
    native = b"".join(encode_kv(layers, "r", "tiny", "rev-1").chunks())
    # the same cache as a machine of the other byte order would send it
    swapped = bytearray()
    for layer in layers:
        for tensor, width in ((layer.positions, 8), (layer.k, 2), (layer.v, 2)):
            raw = tensor.contiguous().view(torch.uint8).reshape(-1, width).flip(1)
            swapped += raw.numpy().tobytes()
    assert len(swapped) == len(native)
    header = dataclasses.replace(encode_kv(layers, "r", "tiny", "rev-1").header, byte_order=other)
    assert_same(layers, receive(header, [bytes(swapped)], dataclasses.replace(SPEC, dtype="float16")))


@pytest.mark.parametrize("layout", ["positions-first", ""])
def test_a_payload_of_an_earlier_release_positions_first_is_received(layout):
    layers = pyramid_cache()
    header = dataclasses.replace(encode_kv(layers, "r", "tiny", "rev-1").header, layout=layout)
    assert_same(layers, receive(header, [positions_first(layers)]))


def test_an_unknown_layout_is_malformed():
    header = dataclasses.replace(encode_kv(pyramid_cache(), "r", "tiny", "rev-1").header,
                                 layout="diagonal")
    with pytest.raises(KVMalformed, match="layout 'diagonal' is not one of"):
        KVAssembler(header, SPEC)


def test_truncated_stream_is_data_loss_and_leaves_nothing():
    encoded = encode_kv(pyramid_cache(), "req-2", "tiny", "rev-1")
    chunks = list(encoded.chunks(1000))
    assembler = KVAssembler(encoded.header, SPEC)
    with pytest.raises(KVDataLoss, match=f"ended after {1000 * (len(chunks) - 1)} of "
                                         f"{encoded.header.total_bytes} bytes"), assembler:
        for chunk in chunks[:-1]:
            assembler.add(chunk)
        assembler.finish(encoded.checksum())
    with pytest.raises(RuntimeError, match="discarded"):
        assembler.add(chunks[-1])


def test_surplus_bytes_are_data_loss():
    encoded = encode_kv(pyramid_cache(), "req-3", "tiny", "rev-1")
    with pytest.raises(KVDataLoss, match="more than"):
        receive(encoded.header, [*encoded.chunks(), b"\0"])


def test_a_crc32_checksum_from_an_earlier_sender_is_taken():
    sent = pyramid_cache()
    encoded = encode_kv(sent, "r", "tiny", "rev-1")
    header = dataclasses.replace(encoded.header, checksum_algorithm="crc32")
    chunks = list(encoded.chunks(1000))
    assert_same(sent, receive(header, chunks, checksum=zlib.crc32(b"".join(chunks))))
    with pytest.raises(KVDataLoss, match="checksum"):
        receive(header, chunks, checksum=encoded.checksum())  # the XXH3 of the same bytes


def test_bad_checksum_is_data_loss():
    encoded = encode_kv(pyramid_cache(), "req-4", "tiny", "rev-1")
    chunks = [bytearray(chunk) for chunk in encoded.chunks(4096)]
    chunks[1][17] ^= 0x40  # one flipped bit somewhere in the keys
    with pytest.raises(KVDataLoss, match="checksum"):
        receive(encoded.header, chunks, checksum=encoded.checksum())
    with pytest.raises(KVDataLoss, match="without its checksum"), \
            KVAssembler(encoded.header, SPEC) as assembler:
        for chunk in encoded.chunks():
            assembler.add(chunk)
        assembler.finish(None)


@pytest.mark.parametrize("change, message", [
    ({"model_id": "other"}, "model 'other' != 'tiny'"),
    ({"model_revision": "rev-2"}, "model revision 'rev-2' != 'rev-1'"),
    ({"num_kv_heads": 4}, "num kv heads 4 != 2"),
    ({"head_dim": 16}, "head_dim 16 != 8"),
    ({"dtype": "float16"}, "kv dtype float16 != float32"),
    ({"dtype": "float8_e4m3fn"}, "kv dtype float8_e4m3fn != float32"),
    ({"kv_scale": 0.5}, "kv scale 0.5 != 1.0"),
])
def test_wrong_model_or_shape_is_incompatible(change, message):
    encoded = encode_kv(pyramid_cache(), "req-5", "tiny", "rev-1")
    with pytest.raises(KVIncompatible, match=message):
        KVAssembler(dataclasses.replace(encoded.header, **change), SPEC)


def test_layer_count_mismatch_is_incompatible():
    layers = pyramid_cache()[:3]
    encoded = encode_kv(layers, "req-6", "tiny", "rev-1")
    with pytest.raises(KVIncompatible, match="num layers 3 != 4"):
        KVAssembler(encoded.header, SPEC)


@pytest.mark.parametrize("change, message", [
    ({"total_bytes": 12}, "total_bytes 12 does not match"),
    ({"layer_num_tokens": (300, 225, 150)}, "says 4 layers but gives token counts for 3"),
    ({"layer_num_tokens": (300, 225, 150, 0)}, "layer 3 holds 0 tokens"),
    ({"layer_num_tokens": (300, 225, 150, 10_000)}, "layer 3 holds 10000 tokens"),
    ({"byte_order": "middle"}, "byte_order 'middle'"),
    ({"dtype": "int8"}, "dtype 'int8'"),
    ({"checksum_algorithm": "md5"}, "checksum_algorithm 'md5'"),
    ({"num_kv_heads": 0}, "of 0 kv heads"),
    ({"num_layers": 0, "layer_num_tokens": ()}, "says 0 layers"),
])
def test_malformed_header_is_rejected_before_allocating(change, message):
    encoded = encode_kv(pyramid_cache(), "req-7", "tiny", "rev-1")
    with pytest.raises(KVMalformed, match=message):
        KVAssembler(dataclasses.replace(encoded.header, **change), SPEC)


@pytest.mark.parametrize("positions, message", [
    (torch.tensor([0, 2, 2, 5]), "layer 2 positions are not strictly increasing"),
    (torch.tensor([0, 3, 2, 5]), "layer 2 positions are not strictly increasing"),
    (torch.tensor([-1, 0, 1, 2]), "layer 2 has positions -1..2"),
    (torch.tensor([0, 1, 2, MAX_TOKENS]), f"layer 2 has positions 0..{MAX_TOKENS}; must lie in"),
])
def test_bad_positions_are_malformed(positions, message):
    layers = [LayerKV(torch.randn(4, HEADS, DIM), torch.randn(4, HEADS, DIM), torch.arange(4))
              for _ in range(LAYERS)]
    layers[2] = LayerKV(layers[2].k, layers[2].v, positions)
    encoded = encode_kv(layers, "req-8", "tiny", "rev-1")
    with pytest.raises(KVMalformed, match=message):
        receive(encoded.header, encoded.chunks())


def test_sender_rejects_inconsistent_layers():
    layers = pyramid_cache()
    layers[1] = LayerKV(layers[1].k, layers[1].v[:-1], layers[1].positions)
    with pytest.raises(ValueError, match="layer 1 has 225 keys, 224 values"):
        encode_kv(layers, "r", "tiny", "rev-1")
    layers = pyramid_cache()
    layers[2] = LayerKV(layers[2].k.double(), layers[2].v, layers[2].positions)
    with pytest.raises(ValueError, match="layer 2 k is torch.float64"):
        encode_kv(layers, "r", "tiny", "rev-1")
