"""The KV cache on the wire: a header, then raw tensor bytes in ~1 MiB chunks, then their
checksum (docs/architecture.md, "KV on the wire").

Design: a prefill chain's tail ships a (pyramid-shaped) cache to a decode pod. The sender
describes the payload in a ``KVHeader`` and streams the bytes of the tensors themselves; no
pickle, no per-element encoding. The payload is, layer by layer (``LAYER_MAJOR``), so that
a layer can leave as soon as it is computed:

    for each layer l   positions int64 [S_l] | K_l [S_l, Hkv, D] (dtype) | V_l [S_l, Hkv, D]

A sender of an earlier release sends every layer's positions first, then each layer's K
and V (``POSITIONS_FIRST``); a receiver takes either. The receiver copies keys and values once:
straight into the pool's blocks as they arrive, once the pool has claimed them
(``KVAssembler.land``), or, kept as the pieces of the chunks they arrived in, when the pool
stores the cache (``baton.transfer.received``). The header keeps per-layer token counts, so it
stays small at any context length (its size is independent of S).

The checksum (XXH3-64; CRC-32 from senders of an earlier release) follows the payload: the
sender computes it as the bytes go out, so its header, which carries the request's first
token, leaves before a byte of the cache is read. The receiver (``KVAssembler``) checks the header against what it serves (``KVSpec``)
before allocating anything, checks the byte count and the checksum after the last chunk,
then the positions; only then does the cache exist for the caller. A stream that ends early
or fails leaves nothing behind (``discard``). Errors say what was wrong with the numbers:

* ``KVMalformed``     the header contradicts itself or the positions are not valid
                      (gRPC INVALID_ARGUMENT)
* ``KVIncompatible``  another model, revision, dtype or shape than the receiver's
                      (gRPC FAILED_PRECONDITION)
* ``KVDataLoss``      missing or surplus bytes, or a checksum mismatch (gRPC DATA_LOSS)

This module knows nothing of gRPC: ``baton.api.convert`` maps headers to protobuf and these
errors to status codes.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import xxhash

from baton.dtypes import DTYPES, dtype_name
from baton.errors import DataLoss, FailedPrecondition, InvalidArgument, ServiceError
from baton.kv.contract import HEADS_COMPLETE, KVContract
from baton.kv.dense import LayerKV

# 1 MiB chunks: well under gRPC's 4 MiB default message limit, and large enough that the
# per-message cost vanishes (bench/kv_transfer.py measures it).
CHUNK_BYTES = 1 << 20
# The payload's checksum, against corruption (mTLS guards against tampering): XXH3's 64-bit
# hash runs about three times as fast as zlib's CRC-32, and a push checksums every byte on
# both ends. A receiver takes either (a sender of an earlier
# release sends CRC-32).
CHECKSUM_ALGORITHM = "xxh3-64"
CHECKSUM_ALGORITHMS = ("xxh3-64", "crc32")
BYTE_ORDERS = ("little", "big")
LAYER_MAJOR = "layer-major"
POSITIONS_FIRST = "positions-first"  # also what an empty layout means (an earlier release)
LAYOUTS = (LAYER_MAJOR, POSITIONS_FIRST, "")
POSITION_DTYPE = torch.int64
POSITION_BYTES = 8


class KVWireError(ServiceError):
    """A pushed KV cache that cannot be accepted; the subclass says why (and its status)."""


class KVMalformed(KVWireError):
    """The header contradicts itself, or the positions are not strictly increasing in range."""

    status = InvalidArgument.status


class KVIncompatible(KVWireError):
    """The cache belongs to another model, revision, dtype or shape than the receiver's, or
    comes over a data plane the receiver lacks."""

    status = FailedPrecondition.status


class KVDataLoss(KVWireError):
    """Bytes are missing or surplus, or the checksum does not match."""

    status = DataLoss.status


@dataclass(frozen=True)
class KVHeader:
    """Describes one pushed cache; ``layer_num_tokens[l]`` is S_l."""

    request_id: str
    model_id: str
    model_revision: str
    dtype: str
    num_layers: int
    layer_num_tokens: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    byte_order: str
    total_bytes: int
    checksum_algorithm: str = CHECKSUM_ALGORITHM  # of the payload, which the checksum follows
    layout: str = LAYER_MAJOR  # the payload's order (``LAYOUTS``)
    kv_scale: float = 1.0  # an fp8 cache's keys and values were stored divided by it

    @property
    def element_bytes(self) -> int:
        return torch.empty(0, dtype=DTYPES[self.dtype]).element_size()

    @property
    def contract(self) -> KVContract:
        """What the header says of the contract the cache was shipped under: its shape."""
        return _shape_contract(self)

    def payload_bytes(self) -> int:
        """The payload size the layer counts imply (``total_bytes`` must equal it)."""
        num_tokens = sum(self.layer_num_tokens)
        tensor_bytes = 2 * num_tokens * self.num_kv_heads * self.head_dim * self.element_bytes
        return num_tokens * POSITION_BYTES + tensor_bytes


@dataclass(frozen=True)
class KVSpec:
    """What a receiver serves: a pushed cache must match it exactly."""

    model_id: str
    model_revision: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_tokens: int  # positions must lie in [0, max_tokens): the model's context length
    kv_scale: float = 1.0  # what the pool's fp8 blocks are scaled by (``baton.kv.storage``)

    @property
    def contract(self) -> KVContract:
        """This receiver's KV contract as far as a pushed cache's header can be checked
        against it (its compression, block size and ranks are the routing record's)."""
        return dataclasses.replace(_shape_contract(self), layout=HEADS_COMPLETE)


def _shape_contract(described: KVHeader | KVSpec) -> KVContract:
    return KVContract(described.model_id, described.model_revision, dtype=described.dtype,
                      kv_scale=described.kv_scale, num_layers=described.num_layers, num_kv_heads=described.num_kv_heads,
                      head_dim=described.head_dim)


class Checksum:
    """The payload's running checksum by one of ``CHECKSUM_ALGORITHMS``, fed piece by piece."""

    def __init__(self, algorithm: str = CHECKSUM_ALGORITHM) -> None:
        if algorithm not in CHECKSUM_ALGORITHMS:
            raise KVMalformed(f"KV checksum_algorithm {algorithm!r} is not one of "
                              f"{CHECKSUM_ALGORITHMS}")
        self._xxh3 = xxhash.xxh3_64() if algorithm == "xxh3-64" else None
        self._crc32 = 0

    def update(self, data: bytes | memoryview) -> None:
        if self._xxh3 is not None:
            self._xxh3.update(data)
        else:
            self._crc32 = zlib.crc32(data, self._crc32)

    @property
    def value(self) -> int:
        return self._xxh3.intdigest() if self._xxh3 is not None else self._crc32


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor as a flat memoryview (a copy only for GPU/strided input)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


# --- sender --------------------------------------------------------------------------------


class EncodedKV:
    """A cache ready to ship: its header, and the byte segments of its payload in order,
    viewed only when first read (the header goes out first, ahead of any of that work)."""

    def __init__(self, header: KVHeader, layers: list[LayerKV]) -> None:
        self.header = header
        self._layers = layers

    @functools.cached_property
    def segments(self) -> list[memoryview]:
        return [segment for layer in self._layers for segment in layer_segments(layer)]

    def checksum(self) -> int:
        """The payload's checksum (what the sender's chunks add up to)."""
        checksum = Checksum(self.header.checksum_algorithm)
        for segment in self.segments:
            checksum.update(segment)
        return checksum.value

    def chunk_pieces(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[memoryview]]:
        """The payload in chunks of ``chunk_bytes`` (``chunk_pieces``)."""
        return chunk_pieces(self.segments, chunk_bytes)

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The payload in chunks of ``chunk_bytes``, each as bytes (a copy)."""
        return (b"".join(pieces) for pieces in self.chunk_pieces(chunk_bytes))


def layer_segments(layer: LayerKV) -> list[memoryview]:
    """One layer's part of the (layer-major) payload: its positions, keys and values."""
    return [_byte_view(layer.positions.to(POSITION_DTYPE)), _byte_view(layer.k),
            _byte_view(layer.v)]


def chunk_pieces(segments: list[memoryview], chunk_bytes: int = CHUNK_BYTES
                 ) -> Iterator[list[memoryview]]:
    """``segments`` in chunks of ``chunk_bytes`` (the last may be shorter), each as the views
    of the segments it spans: nothing is copied here."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    pieces: list[memoryview] = []
    pending = 0
    for segment in segments:
        offset = 0
        while offset < len(segment):
            take = min(chunk_bytes - pending, len(segment) - offset)
            pieces.append(segment[offset:offset + take])
            pending += take
            offset += take
            if pending == chunk_bytes:
                yield pieces
                pieces, pending = [], 0
    if pending:
        yield pieces


def kv_header(layer_num_tokens: tuple[int, ...], dtype: torch.dtype, num_kv_heads: int,
              head_dim: int, request_id: str, model_id: str, model_revision: str,
              kv_scale: float = 1.0) -> KVHeader:
    """The header of a (layer-major) cache with these shapes, before any of it exists
    (``kv_scale``: an fp8 cache's, ``baton.kv.storage``)."""
    header = KVHeader(request_id=request_id, model_id=model_id, model_revision=model_revision,
                      dtype=dtype_name(dtype), num_layers=len(layer_num_tokens),
                      layer_num_tokens=tuple(layer_num_tokens), num_kv_heads=num_kv_heads,
                      head_dim=head_dim, byte_order=sys.byteorder, total_bytes=0,
                      kv_scale=kv_scale)
    return dataclasses.replace(header, total_bytes=header.payload_bytes())


def encode_kv(layers: list[LayerKV], request_id: str, model_id: str,
              model_revision: str, kv_scale: float = 1.0) -> EncodedKV:
    """Describe a cache for shipping (k, v: [S_l, Hkv, D], as stored: fp8 ones divided by
    ``kv_scale``; positions: [S_l]); nothing is read yet (the checksum is taken as the
    chunks go out: ``checksum``)."""
    if not layers:
        raise ValueError("cannot ship a KV cache with no layers")
    first = layers[0].k
    dtype, num_kv_heads, head_dim = first.dtype, first.shape[1], first.shape[2]
    for index, layer in enumerate(layers):
        for name, tensor in (("k", layer.k), ("v", layer.v)):
            if tensor.dtype != dtype or tuple(tensor.shape[1:]) != (num_kv_heads, head_dim):
                raise ValueError(f"layer {index} {name} is {tensor.dtype} {tuple(tensor.shape)}, "
                                 f"layer 0 k is {dtype} [S, {num_kv_heads}, {head_dim}]")
        if layer.v.shape[0] != layer.num_tokens or layer.positions.shape != (layer.num_tokens,):
            raise ValueError(f"layer {index} has {layer.num_tokens} keys, {layer.v.shape[0]} values "
                             f"and {tuple(layer.positions.shape)} positions")
    header = kv_header(tuple(layer.num_tokens for layer in layers), dtype, num_kv_heads,
                       head_dim, request_id, model_id, model_revision, kv_scale)
    return EncodedKV(header, layers)


# --- receiver ------------------------------------------------------------------------------


def check_header(header: KVHeader, spec: KVSpec) -> None:
    """Raise KVMalformed / KVIncompatible unless ``header`` is sound and matches ``spec``."""
    if header.dtype not in DTYPES:
        raise KVMalformed(f"KV dtype {header.dtype!r} is not one of {sorted(DTYPES)}")
    if header.byte_order not in BYTE_ORDERS:
        raise KVMalformed(f"KV byte_order {header.byte_order!r} is not one of {BYTE_ORDERS}")
    if header.layout not in LAYOUTS:
        raise KVMalformed(f"KV layout {header.layout!r} is not one of {LAYOUTS[:2]}")
    if header.checksum_algorithm not in CHECKSUM_ALGORITHMS:
        raise KVMalformed(f"KV checksum_algorithm {header.checksum_algorithm!r} is not one of "
                          f"{CHECKSUM_ALGORITHMS}")
    if header.num_layers != len(header.layer_num_tokens):
        raise KVMalformed(f"KV header says {header.num_layers} layers but gives token counts "
                          f"for {len(header.layer_num_tokens)}")
    if min(header.num_layers, header.num_kv_heads, header.head_dim) < 1:  # a header says its shape
        raise KVMalformed(f"KV header says {header.num_layers} layers of {header.num_kv_heads} "
                          f"kv heads of head_dim {header.head_dim}; each must be >= 1")
    mismatches = header.contract.mismatches(spec.contract)  # the rule routing applies too
    if mismatches:
        raise KVIncompatible(f"the pushed KV does not fit this pod's KV contract: "
                             f"{'; '.join(mismatches)}")
    for layer, num_tokens in enumerate(header.layer_num_tokens):
        if not 0 < num_tokens <= spec.max_tokens:
            raise KVMalformed(f"KV layer {layer} holds {num_tokens} tokens; "
                              f"must be in 1..{spec.max_tokens}")
    if header.total_bytes != header.payload_bytes():
        raise KVMalformed(f"KV total_bytes {header.total_bytes} does not match the "
                          f"{header.payload_bytes()} bytes the layer token counts imply")
