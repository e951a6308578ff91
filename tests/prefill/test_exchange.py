"""What the chain's rendezvous store holds and who can use it: a real TCPStore bound to one
address, values sealed with the chain's key (an outsider who reaches the port reads no
request and cannot forge an event), events through the EventPump."""

from __future__ import annotations

import asyncio
import datetime
import os
import socket

import pytest
import torch.distributed as dist
from baton.api import convert
from baton.api.requests import CompressionParams, PrefillRequest
from baton.model.sampling import SamplingParams
from baton.prefill.exchange import ChainExchange, ChainTampered, EventPump


@pytest.fixture
def store_port():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, 1, is_master=True,
                           timeout=datetime.timedelta(seconds=10), master_listen_fd=listener.detach())
    yield port
    del master  # closes the socket


def exchange(port: int, key: bytes) -> ChainExchange:
    sealed = ChainExchange("127.0.0.1", port)
    sealed.seal_with(key)
    return sealed


REQUEST = PrefillRequest(request_id="secret-request-7", model="m", prompt_token_ids=(9001, 9002, 9003),
                         sampling=SamplingParams(temperature=0.0, max_tokens=4),
                         compression=CompressionParams(), decode_address="10.1.2.3:50061")


def test_a_request_in_the_store_is_unreadable_without_the_chains_key(store_port):
    key = os.urandom(32)
    exchange(store_port, key).publish_request(7, REQUEST)
    assert exchange(store_port, key).read_request(7, 5.0) == REQUEST  # the tail reads it
    outsider = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                             timeout=datetime.timedelta(seconds=5))
    raw = outsider.get("baton/prefill/request/7")
    for secret in (b"secret-request-7", b"10.1.2.3"):
        assert secret not in raw
    # nothing of the plaintext shows, the token ids' varints included: no 8 bytes of it (a
    # shorter window would turn up in random ciphertext by chance now and then)
    plain = convert.prefill_request_to_proto(REQUEST).SerializeToString()
    assert not [plain[i:i + 8] for i in range(len(plain) - 7) if plain[i:i + 8] in raw]
    with pytest.raises(ChainTampered):
        exchange(store_port, os.urandom(32)).read_request(7, 5.0)  # another chain's key


def test_an_event_forged_by_an_outsider_fails_the_request_not_the_chain(store_port):
    key = os.urandom(32)
    rank0 = exchange(store_port, key)
    pump = EventPump(rank0)
    try:
        outsider = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                                 timeout=datetime.timedelta(seconds=5))
        outsider.set("baton/prefill/first/3", b'{"token_id": 666, "partition": [0, 1]}')
        outsider.add("baton/prefill/events", 1)
        forged = asyncio.run(pump.wait(3, "first", 5.0))
        assert forged["error"]["code"] == "DATA_LOSS"
        exchange(store_port, key).report(4, "first", {"token_id": 5, "partition": [0, 9]})
        assert asyncio.run(pump.wait(4, "first", 5.0)) == {"token_id": 5, "partition": [0, 9]}
    finally:
        pump.stop()
