"""NIXL, the second KV data plane, on this machine's CPU (UCX moves the bytes between two
real agents): a pushed cache read over NIXL is the cache sent in chunks, whatever the
pieces' boundaries; a receiver without NIXL, bad regions, memory the sender never
registered and bytes changed after their checksum are each refused with their own error.
Skipped, with the reason, where the nixl package is not installed (`make nixl`)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import threading
from pathlib import Path

import pytest
import torch
from baton.api.requests import CompressionParams
from baton.kv.dense import LayerKV
from baton.sampling.params import SamplingParams
from baton.transfer import framing
from baton.transfer.assembler import KVAssembler
from baton.transfer.codec import (
    KVDataLoss,
    KVIncompatible,
    KVMalformed,
    KVSpec,
    encode_kv,
    layer_segments,
)
from baton.transfer.handoff import FirstToken, KVHandoff
from baton.transfer.nixl import NixlAgent, NixlReader, NixlSource, Regions, nixl_missing
from baton.transfer.receiver import NixlPlane, receive_body

pytestmark = pytest.mark.skipif(nixl_missing() is not None, reason=str(nixl_missing()))

SPEC = KVSpec(model_id="m", model_revision="rev", dtype="float32", num_layers=3,
              num_kv_heads=2, head_dim=4, max_tokens=64)


@pytest.fixture(scope="module")
def agents():
    """A pusher's agent and a pod's, in this process; the pusher's makes progress on a thread
    of its own (as a tail does between layers and while it waits for the pod's answer)."""
    # Given the pods' listen host, as the servers give it: UCX keeps to that interface.
    sender, receiver = NixlAgent("prefill", "127.0.0.1"), NixlAgent("decode", "127.0.0.1")
    stop = threading.Event()

    def progress() -> None:
        while not stop.wait(1e-3):
            sender.agent.get_new_notifs()

    thread = threading.Thread(target=progress, daemon=True)
    thread.start()
    yield sender, receiver
    stop.set()
    thread.join()


def cache() -> list[LayerKV]:
    return [LayerKV(torch.randn(n, 2, 4), torch.randn(n, 2, 4), torch.arange(n) * 2)
            for n in (9, 5, 7)]


def handoff_of(layers, follows: bool = False) -> KVHandoff:
    encoded = encode_kv(layers, "r1", "m", "rev")
    return KVHandoff(encoded.header, tuple(range(20)), 0 if follows else 77,
                     SamplingParams(max_tokens=4), CompressionParams(), first_token_follows=follows)


async def messages_of(sent):
    for message in sent:  # as they cross the wire
        yield framing.parse(framing.serialize(message))


@contextlib.contextmanager
def offered(sender: NixlAgent, layers: list[LayerKV]):
    """A whole cache's push to a pod that reads over NIXL: its handoff and messages, its
    memory registered until the block ends."""
    handoff = handoff_of(layers)
    source = NixlSource(sender)
    try:
        yield handoff, list(framing.nixl_messages(
            handoff, encode_kv(layers, "r1", "m", "rev").segments, source))
    finally:
        source.release()


def receive(handoff, sent, plane: NixlPlane | None, **kwargs):
    """The pod's side of a push whose messages were ``sent`` (the header read already)."""
    assert framing.header_of(sent[0]) == handoff
    return asyncio.run(receive_body(handoff, messages_of(sent[1:]), SPEC, nixl=plane, **kwargs))


def assert_same_cache(received, layers):
    assert len(received.layers) == len(layers)
    for got, want in zip(received.layers, layers):
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
        assert torch.equal(got.positions, want.positions)


def test_a_cache_read_over_nixl_is_the_cache_sent_in_chunks(agents):
    sender, receiver = agents
    layers = cache()
    with offered(sender, layers) as (handoff, sent):
        assert [m.WhichOneof("part") for m in sent] == ["header", "nixl", "trailer"]
        received = receive(handoff, sent, NixlPlane(NixlReader(receiver), 10.0))
    assert_same_cache(received, layers)
    assert received.num_bytes == handoff.kv.total_bytes


def test_layer_by_layer_over_nixl_with_the_first_token_before_the_last_layer(agents):
    sender, receiver = agents
    layers = cache()
    handoff = handoff_of(layers, follows=True)
    source, sent, firsts = NixlSource(sender), [], []
    writer = framing.LayerByLayer(handoff, sent.append, source)
    writer.layer(layer_segments(layers[0]))
    writer.layer(layer_segments(layers[1]))
    writer.first_token(FirstToken(77, 0.5, (0, 20)))
    writer.layer(layer_segments(layers[2]))
    writer.finish()
    assert [m.WhichOneof("part") for m in sent] == [
        "header", "nixl", "nixl", "first_token", "nixl", "trailer"]

    async def first(complete):
        firsts.append(complete.first_token_id)

    try:
        received = receive(handoff, sent, NixlPlane(NixlReader(receiver), 10.0),
                           on_first_token=first)
    finally:
        source.release()
    assert_same_cache(received, layers) and firsts == [77]
    assert received.handoff.first_token_id == 77


def test_layers_that_share_a_tensor_are_offered_and_released(agents):
    # Unpruned layers share their positions: one region named twice in one offer.
    sender, receiver = agents
    positions = torch.arange(6)
    layers = [LayerKV(torch.randn(6, 2, 4), torch.randn(6, 2, 4), positions) for _ in range(3)]
    with offered(sender, layers) as (handoff, sent):
        received = receive(handoff, sent, NixlPlane(NixlReader(receiver), 10.0))
    assert_same_cache(received, layers)


def test_a_read_pairs_pieces_cut_at_different_boundaries_on_either_side(agents):
    sender, receiver = agents
    payload = torch.randint(0, 255, (1000,), dtype=torch.uint8)
    views = memoryview(payload.numpy())
    source = NixlSource(sender)
    regions = source.offer([views[:10], views[10:600], views[600:]])
    target = torch.zeros(1000, dtype=torch.uint8)
    out = memoryview(target.numpy())
    try:
        asyncio.run(NixlReader(receiver).read(regions, [out[:333], out[333:334], out[334:]], 10.0))
    finally:
        source.release()
    assert torch.equal(target, payload)


def test_a_pod_without_nixl_refuses_bytes_left_for_a_nixl_read(agents):
    sender, _ = agents
    with offered(sender, cache()) as (handoff, sent), \
            pytest.raises(KVIncompatible, match="gRPC only"):
        receive(handoff, sent, None)


def test_bytes_changed_after_their_checksum_are_data_loss(agents):
    sender, receiver = agents
    layers = cache()
    with offered(sender, layers) as (handoff, sent):
        layers[1].k.add_(1.0)  # the memory the pod reads, after the checksum was taken
        with pytest.raises(KVDataLoss, match="checksum"):
            receive(handoff, sent, NixlPlane(NixlReader(receiver), 10.0))


def tcp_listeners() -> dict[str, ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """This process's listening TCP sockets (by inode) and their addresses, read off /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if (link := os.readlink(f"/proc/self/fd/{fd}")).startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    addresses = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                # the kernel prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                addresses[fields[9]] = ipaddress.ip_address(words)
    return addresses


def test_an_agent_listens_only_where_its_pod_does():
    before = tcp_listeners()
    agent = NixlAgent("decode-on-loopback", "127.0.0.1")
    opened = [address for inode, address in tcp_listeners().items() if inode not in before]
    assert opened and all(address.is_loopback for address in opened), opened
    assert "UCX_NET_DEVICES" not in os.environ  # only while the agent started
    del agent


def test_memory_the_sender_did_not_register_is_not_read(agents):
    # A sender of its own: the module's may still hold regions an earlier test registered,
    # and the secret could land in memory one of them covers.
    _, receiver = agents
    sender = NixlAgent("prefill-registering-one-region")
    registered = torch.ones(64, dtype=torch.uint8)
    secret = torch.full((64,), 7, dtype=torch.uint8)
    source = NixlSource(sender)
    regions = source.offer([memoryview(registered.numpy())])
    elsewhere = Regions(regions.agent_metadata, (secret.data_ptr(),), (64,))
    target = torch.zeros(64, dtype=torch.uint8)
    try:
        with pytest.raises(KVDataLoss, match="could not start"):
            asyncio.run(NixlReader(receiver).read(elsewhere, [memoryview(target.numpy())], 10.0))
    finally:
        source.release()
    assert int(target.sum()) == 0


@pytest.mark.parametrize("regions, message", [
    (Regions(b"", (1,), (8,)), "agent_metadata is 0 bytes"),
    (Regions(b"x", (1, 2), (8,)), "2 addresses and 1 lengths"),
    (Regions(b"x", (), ()), "names 0 regions"),
    (Regions(b"x", (1,), (0,)), "empty region"),
])
def test_malformed_regions_are_refused_before_any_read(agents, regions, message):
    _, receiver = agents
    with pytest.raises(KVMalformed, match=message):
        asyncio.run(NixlReader(receiver).read(regions, [memoryview(bytearray(8))], 10.0))


def test_regions_for_more_bytes_than_the_header_announced_are_data_loss():
    layers = cache()
    handoff = handoff_of(layers)
    with KVAssembler(handoff.kv, SPEC) as assembler, pytest.raises(KVDataLoss, match="more than"):
        assembler.next_views(handoff.kv.total_bytes + 1)


def test_metadata_that_is_no_agent_s_is_malformed(agents):
    _, receiver = agents
    with pytest.raises(KVMalformed, match="not a NIXL agent's"):
        asyncio.run(NixlReader(receiver).read(Regions(b"garbage", (4096,), (8,)),
                                              [memoryview(bytearray(8))], 10.0))
