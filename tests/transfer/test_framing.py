"""PushKV's stream framed by hand: its chunk messages are PushKVRequest's own bytes, parsed
without a copy, and either end may be a plain generated stub or servicer."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch
from baton.api.requests import CompressionParams
from baton.api.v1 import decode_pb2, decode_pb2_grpc
from baton.kv.dense import LayerKV
from baton.sampling.params import SamplingParams
from baton.transfer import framing as push_kv
from baton.transfer.codec import KVDataLoss, KVMalformed, encode_kv, layer_segments
from baton.transfer.handoff import FirstToken, KVHandoff
from decode.decode_servers import proto_messages


def handoff_and_encoded():
    layers = [LayerKV(torch.randn(n, 2, 4), torch.randn(n, 2, 4), torch.arange(n) * 2)
              for n in (9, 5)]
    encoded = encode_kv(layers, "r6", "m", "rev")
    handoff = KVHandoff(encoded.header, (1, 2, 3), 77, SamplingParams(max_tokens=4),
                        CompressionParams(), prefill_s=0.25, partition=(0, 2, 3))
    return handoff, encoded


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 1 << 20])
def test_a_chunk_is_framed_as_protobuf_frames_it_and_parsed_as_a_view(size):
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    pieces = [memoryview(payload)[:size // 3], payload[size // 3:]]
    framed = push_kv.serialize(push_kv.Chunk(pieces))
    assert framed == decode_pb2.PushKVRequest(chunk=payload).SerializeToString()
    parsed = push_kv.parse(framed)
    assert isinstance(parsed, push_kv.Chunk) and b"".join(parsed.pieces) == payload
    assert isinstance(parsed.pieces[0], memoryview) and parsed.pieces[0].obj is framed  # no copy


def test_anything_but_a_lone_chunk_is_parsed_by_protobuf():
    header = decode_pb2.PushKVRequest(header=decode_pb2.PushKVHeader(first_token_id=5))
    assert push_kv.parse(header.SerializeToString()) == header
    # a chunk field followed by another field: protobuf's rules (the last one set wins)
    two = (decode_pb2.PushKVRequest(chunk=b"abc").SerializeToString()
           + decode_pb2.PushKVRequest(trailer=decode_pb2.PushKVTrailer(checksum=9)).SerializeToString())
    parsed = push_kv.parse(two)
    assert not isinstance(parsed, push_kv.Chunk) and parsed.trailer.checksum == 9
    with pytest.raises(Exception):  # noqa: B017 - protobuf's DecodeError
        push_kv.parse(b"\x12\x05ab")  # a chunk cut short


def test_a_push_built_layer_by_layer_sends_the_same_bytes_and_its_first_token_before_the_last():
    layers = [LayerKV(torch.randn(n, 2, 4), torch.randn(n, 2, 4), torch.arange(n) * 2)
              for n in (9, 5)]
    encoded = encode_kv(layers, "r6", "m", "rev")
    follows = KVHandoff(encoded.header, (1, 2, 3), 0, SamplingParams(max_tokens=4),
                        CompressionParams(), first_token_follows=True)
    sent = []
    writer = push_kv.LayerByLayer(follows, sent.append)
    writer.layer(layer_segments(layers[0]))
    writer.first_token(FirstToken(77, 0.25, (0, 2, 3)))
    writer.layer(layer_segments(layers[1]))
    writer.finish()
    received, parts = push_kv.read(iter([push_kv.parse(push_kv.serialize(m)) for m in sent]))
    assert received == follows
    *payload, checksum = parts
    first = [part for part in payload if isinstance(part, FirstToken)]
    assert first == [FirstToken(77, 0.25, (0, 2, 3))]
    assert isinstance(payload[-2], FirstToken)  # the last layer (one chunk here) after it
    chunks = [b"".join(pieces) for pieces in payload if not isinstance(pieces, FirstToken)]
    assert b"".join(chunks) == b"".join(encoded.chunks())  # the layer-major payload, as encoded
    assert checksum == encoded.checksum()
    assert received.with_first(first[0]) == KVHandoff(
        encoded.header, (1, 2, 3), 77, SamplingParams(max_tokens=4), CompressionParams(),
        prefill_s=0.25, partition=(0, 2, 3))


def test_the_stream_round_trips_with_the_checksum_of_its_chunks():
    handoff, encoded = handoff_and_encoded()
    wire = [push_kv.parse(push_kv.serialize(m))
            for m in push_kv.messages(handoff, encoded.chunk_pieces(64))]
    received, parts = push_kv.read(iter(wire))
    assert received == handoff
    *chunks, checksum = parts
    assert b"".join(b"".join(pieces) for pieces in chunks) == b"".join(encoded.chunks())
    assert checksum == encoded.checksum()


def test_stream_shape_errors():
    chunk = decode_pb2.PushKVRequest(chunk=b"abc")
    with pytest.raises(KVMalformed, match="open with a header"):
        push_kv.read(iter([chunk]))
    with pytest.raises(KVMalformed, match="open with a header"):
        push_kv.read(iter([push_kv.Chunk([b"abc"])]))
    with pytest.raises(KVDataLoss):
        push_kv.read(iter([]))
    header = decode_pb2.PushKVRequest(header=decode_pb2.PushKVHeader())
    _, parts = push_kv.read(iter([header, chunk, header]))
    with pytest.raises(KVMalformed, match="second header"):
        list(parts)


class Receiver(decode_pb2_grpc.DecodeServicer):
    def PushKV(self, request_iterator, context):
        handoff, parts = push_kv.read(request_iterator)
        received = b"".join(b"".join(part) for part in parts if not isinstance(part, int))
        return decode_pb2.PushKVResponse(request_id=handoff.request_id,
                                         bytes_received=len(received))


@pytest.mark.parametrize("framed_sender, framed_server", [(True, True), (False, True), (True, False)])
def test_either_end_may_be_generated_code(framed_sender, framed_server):
    handoff, encoded = handoff_and_encoded()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    if framed_server:
        push_kv.add_decode_servicer(Receiver(), server)
    else:
        decode_pb2_grpc.add_DecodeServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            if framed_sender:
                reply = push_kv.stub_push_kv(channel)(
                    push_kv.messages(handoff, encoded.chunk_pieces(100)), timeout=10)
            else:
                reply = decode_pb2_grpc.DecodeStub(channel).PushKV(
                    proto_messages(handoff, encoded.chunks(100)), timeout=10)
    finally:
        server.stop(None)
    assert reply.request_id == "r6" and reply.bytes_received == encoded.header.total_bytes
