"""The PushKV stream: a header, the KV payload in chunks, a trailer with the checksum; its
chunk messages framed by hand (docs/architecture.md, "KV on the wire"). A tail that ships
each layer as it is computed sends the first token in a message of its own, before the
last layer's bytes (``LayerByLayer``); otherwise it rides on the header (``messages``). To a
pod that reads over NIXL, a ``PushKVNixl`` message (where the bytes lie in the sender's
memory: ``baton.transfer.nixl``) stands in for each layer's chunks, or for all of them.

Protobuf's Python runtime copies a ``bytes`` field each time a message is built, serialized,
parsed or read: four copies of every byte of the cache, slower together than the socket
itself. A chunk message is one length-delimited field, so its encoding is trivial: the
sender writes the tag, the length and the payload's pieces into the one buffer gRPC takes
(``serialize``); the receiver finds the payload as a view of the buffer gRPC gave it
(``parse``) and keeps it until the pool copies it into its blocks (``baton.transfer.received``).
The bytes on the wire are ``PushKVRequest``'s own encoding, so either side may be a plain
generated stub or servicer: ``parse`` falls back to protobuf for anything but a lone chunk
field.

``stub_push_kv`` and ``add_decode_servicer`` are the hand-framed ends of Decode.PushKV.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence

import grpc

from baton.api.convert import (
    compression_from_proto,
    compression_to_proto,
    flat_from_proto,
    flat_to_proto,
    logprobs_from_proto,
    logprobs_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from baton.api.v1 import decode_pb2, decode_pb2_grpc, kv_pb2
from baton.sampling.logprobs import TokenLogprobs
from baton.transfer.codec import Checksum, KVDataLoss, KVHeader, KVMalformed, chunk_pieces
from baton.transfer.handoff import FirstToken, KVHandoff
from baton.transfer.nixl import NixlSource, Regions

METHOD = "/baton.v1.Decode/PushKV"
_CHUNK_FIELD = decode_pb2.PushKVRequest.DESCRIPTOR.fields_by_name["chunk"].number
_CHUNK_TAG = (_CHUNK_FIELD << 3) | 2  # wire type 2: length-delimited
_TAG_BYTE = bytes([_CHUNK_TAG])


# --- the header and the first token: domain <-> proto ---------------------------------------

def kv_header_to_proto(header: KVHeader) -> kv_pb2.KVHeader:
    return flat_to_proto(header, kv_pb2.KVHeader)


def kv_header_from_proto(message: kv_pb2.KVHeader) -> KVHeader:
    header = flat_from_proto(message, KVHeader)
    return dataclasses.replace(header, layer_num_tokens=tuple(header.layer_num_tokens),
                               kv_scale=header.kv_scale or 1.0)


def handoff_to_proto(handoff: KVHandoff) -> decode_pb2.PushKVHeader:
    return decode_pb2.PushKVHeader(
        kv=kv_header_to_proto(handoff.kv), prompt_token_ids=handoff.prompt_token_ids,
        first_token_id=handoff.first_token_id, sampling=sampling_to_proto(handoff.sampling),
        compression=compression_to_proto(handoff.compression),
        decode_incarnation=handoff.decode_incarnation, cache_salt=handoff.cache_salt,
        prefill_s=handoff.prefill_s, partition=handoff.partition,
        first_token_follows=handoff.first_token_follows,
        first_token_logprobs=_logprobs_to_proto(handoff.first_token_logprobs))


def handoff_from_proto(message: decode_pb2.PushKVHeader) -> KVHandoff:
    return KVHandoff(kv=kv_header_from_proto(message.kv),
                     prompt_token_ids=tuple(message.prompt_token_ids),
                     first_token_id=message.first_token_id,
                     sampling=sampling_from_proto(message.sampling),
                     compression=compression_from_proto(message.compression),
                     decode_incarnation=message.decode_incarnation, cache_salt=message.cache_salt,
                     prefill_s=message.prefill_s, partition=tuple(message.partition),
                     first_token_follows=message.first_token_follows,
                     first_token_logprobs=_logprobs_from_proto(message, "first_token_logprobs"))


def first_token_to_proto(first: FirstToken) -> decode_pb2.PushKVFirstToken:
    return decode_pb2.PushKVFirstToken(token_id=first.token_id, prefill_s=first.prefill_s,
                                       partition=first.partition,
                                       logprobs=_logprobs_to_proto(first.logprobs))


def first_token_from_proto(message: decode_pb2.PushKVFirstToken) -> FirstToken:
    return FirstToken(message.token_id, message.prefill_s, tuple(message.partition),
                      _logprobs_from_proto(message, "logprobs"))


def _logprobs_to_proto(entry: TokenLogprobs | None):
    return None if entry is None else logprobs_to_proto(entry)


def _logprobs_from_proto(message, name: str) -> TokenLogprobs | None:
    return logprobs_from_proto(getattr(message, name)) if message.HasField(name) else None


# --- chunks, framed by hand -----------------------------------------------------------------

class Chunk:
    """One payload chunk in place of ``PushKVRequest(chunk=...)``: the pieces it is made of
    (sender), or one view of the received message (receiver)."""

    __slots__ = ("pieces",)

    def __init__(self, pieces: Sequence[bytes | memoryview]) -> None:
        self.pieces = pieces

    @property
    def num_bytes(self) -> int:
        return sum(len(piece) for piece in self.pieces)


PushKVMessage = decode_pb2.PushKVRequest | Chunk


def messages(handoff: KVHandoff, chunks: Iterable[Sequence[bytes | memoryview]]
             ) -> Iterator[PushKVMessage]:
    """The stream: the header, one ``Chunk`` per group of pieces, then the trailer with the
    checksum of the chunks, taken as they go out."""
    yield decode_pb2.PushKVRequest(header=handoff_to_proto(handoff))
    checksum = Checksum(handoff.kv.checksum_algorithm)
    for pieces in chunks:
        for piece in pieces:
            checksum.update(piece)
        yield Chunk(pieces)
    yield decode_pb2.PushKVRequest(trailer=decode_pb2.PushKVTrailer(checksum=checksum.value))


def nixl_messages(handoff: KVHandoff, segments: Sequence[memoryview], source: NixlSource
                  ) -> Iterator[PushKVMessage]:
    """``messages`` to a pod that reads over NIXL: the header, where the whole payload lies
    (``source`` registers it, and holds it until released), the trailer."""
    yield decode_pb2.PushKVRequest(header=handoff_to_proto(handoff))
    checksum = Checksum(handoff.kv.checksum_algorithm)
    for segment in segments:
        checksum.update(segment)
    yield nixl_message(source.offer(segments))
    yield decode_pb2.PushKVRequest(trailer=decode_pb2.PushKVTrailer(checksum=checksum.value))


def nixl_message(regions: Regions) -> decode_pb2.PushKVRequest:
    return decode_pb2.PushKVRequest(nixl=decode_pb2.PushKVNixl(
        agent_metadata=regions.agent_metadata, addresses=regions.addresses,
        lengths=regions.lengths))


class LayerByLayer:
    """A push whose messages are made as the chain computes: the header (its first token to
    follow) at once, each layer's bytes when the layer is done (or, with a NIXL ``source``,
    where they lie), the first token once the logits exist, then the trailer. ``send`` takes
    each message in order."""

    def __init__(self, handoff: KVHandoff, send: Callable[[PushKVMessage], None],
                 source: NixlSource | None = None) -> None:
        assert handoff.first_token_follows, "the first token follows the header"
        self._send = send
        self._source = source
        self._checksum = Checksum(handoff.kv.checksum_algorithm)
        send(decode_pb2.PushKVRequest(header=handoff_to_proto(handoff)))

    def layer(self, segments: list[memoryview]) -> None:
        """One layer's part of the payload (``baton.transfer.codec.layer_segments``)."""
        if self._source is not None:
            for segment in segments:
                self._checksum.update(segment)
            self._send(nixl_message(self._source.offer(segments)))
            return
        for pieces in chunk_pieces(segments):
            for piece in pieces:
                self._checksum.update(piece)
            self._send(Chunk(pieces))

    def first_token(self, first: FirstToken) -> None:
        self._send(decode_pb2.PushKVRequest(first_token=first_token_to_proto(first)))

    def finish(self) -> None:
        self._send(decode_pb2.PushKVRequest(
            trailer=decode_pb2.PushKVTrailer(checksum=self._checksum.value)))


def serialize(message: PushKVMessage) -> bytes:
    """A message's bytes: a chunk's framed by hand (one copy of its pieces), others by protobuf."""
    if not isinstance(message, Chunk):
        return message.SerializeToString()
    return b"".join([_TAG_BYTE, _varint(message.num_bytes), *message.pieces])


def parse(data: bytes) -> PushKVMessage:
    """A received message: a ``Chunk`` viewing ``data`` when it is one chunk field and
    nothing else, else the parsed ``PushKVRequest``."""
    if data[:1] == _TAG_BYTE:
        length, start = _read_varint(data, 1)
        if length >= 0 and start + length == len(data):
            return Chunk((memoryview(data)[start:],))
    return decode_pb2.PushKVRequest.FromString(data)


def header_of(first: PushKVMessage | None) -> KVHandoff:
    """The handoff a PushKV stream opens with (``first`` is None for an empty stream)."""
    if first is None:
        raise KVDataLoss("PushKV stream ended before its header")
    if isinstance(first, Chunk) or first.WhichOneof("part") != "header":
        raise KVMalformed("PushKV stream must open with a header, got a chunk")
    return handoff_from_proto(first.header)


def part_of(message: PushKVMessage
            ) -> Sequence[bytes | memoryview] | int | FirstToken | Regions:
    """A message after a PushKV stream's header: a payload chunk's pieces, where the next
    bytes lie for a NIXL read (``Regions``), the first token (when the header said it
    follows), or the trailer's checksum (int), which must be the last message."""
    if isinstance(message, Chunk):
        return message.pieces
    kind = message.WhichOneof("part")
    if kind == "chunk":
        return (message.chunk,)
    if kind == "trailer":
        return message.trailer.checksum
    if kind == "first_token":
        return first_token_from_proto(message.first_token)
    if kind == "nixl":
        nixl = message.nixl
        return Regions(nixl.agent_metadata, tuple(nixl.addresses), tuple(nixl.lengths))
    raise KVMalformed("PushKV stream sent a second header" if kind == "header" else
                      "PushKV stream sent an empty message")


def read(stream: Iterator[PushKVMessage]
         ) -> tuple[KVHandoff, Iterator[Sequence[bytes | memoryview] | int | FirstToken]]:
    """Split a PushKV stream into its handoff and the parts after it (``part_of``).

    Raises KVMalformed when the stream does not open with a header or repeats it; an empty
    stream is KVDataLoss (nothing arrived)."""
    handoff = header_of(next(stream, None))
    return handoff, (part_of(message) for message in stream)


def stub_push_kv(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    """Decode.PushKV on ``channel``, sending ``messages`` as they are framed here."""
    return channel.stream_unary(METHOD, request_serializer=serialize,
                                response_deserializer=decode_pb2.PushKVResponse.FromString)


def add_decode_servicer(servicer: decode_pb2_grpc.DecodeServicer, server) -> None:
    """Serve the Decode service on ``server`` (sync or asyncio), its PushKV messages parsed
    here: the generated handlers, PushKV's deserializer replaced."""
    handlers = _GeneratedHandlers()
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, handlers)
    push = handlers.methods["PushKV"]
    handlers.methods["PushKV"] = grpc.stream_unary_rpc_method_handler(
        push.stream_unary, request_deserializer=parse,
        response_serializer=push.response_serializer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        handlers.service, handlers.methods),))
    server.add_registered_method_handlers(handlers.service, handlers.methods)


class _GeneratedHandlers:
    """Takes the handlers the generated ``add_DecodeServicer_to_server`` registers."""

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        pass  # the same handlers come to add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, methods: dict) -> None:
        self.service, self.methods = service, dict(methods)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, offset: int) -> tuple[int, int]:
    """The varint at ``offset`` and the offset after it; (-1, offset) when it is cut short."""
    value = shift = 0
    for index in range(offset, min(len(data), offset + 10)):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    return -1, offset
