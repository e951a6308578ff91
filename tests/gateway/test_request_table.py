"""The gateway's request table: what another gateway replica finds in the routing store."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from baton.gateway.request_table import DuplicateRequest, RequestTable
from baton.gateway.routing_policy import InFlight
from baton.routing import InMemoryStore, RequestRecord


def test_a_moved_request_is_found_where_it_lives_now_by_another_replica():
    store = InMemoryStore()
    live = RequestTable(store, ttl_s=60).admit(RequestRecord("r1", "pod-a:1", chain_id="c0",
                                                             prefill_address="chain:1"), 10)
    other_replica = RequestTable(store, ttl_s=60)
    assert other_replica.find_record("r1") == live.record
    moved = dataclasses.replace(live.record, decode_address="pod-b:1", attempt=1)
    live.rewrite(moved)  # what the relay does when a chain fails it and it is sent again
    found = other_replica.find_record("r1")
    assert found == moved and found.pod_request_id == "r1~1"
    with pytest.raises(DuplicateRequest):  # still one live request under that id
        other_replica.admit(RequestRecord("r1", "pod-c:1"), 10)


def test_an_id_the_gateway_made_is_recorded_later_and_removed_only_after_that():
    store = InMemoryStore()
    table = RequestTable(store, ttl_s=60)
    live = table.admit(RequestRecord("made-1", "pod-a:1"), 10, new_id=True)
    assert store.get_request("made-1") is None  # not on the first token's path
    assert table.get("made-1") is live  # but live here at once
    finishing = threading.Thread(target=table.finish, args=("made-1",))
    finishing.start()  # the request ended before its record was written
    finishing.join(0.2)
    assert finishing.is_alive(), "the removal waits for the first write"
    table.record(live)
    finishing.join(10)
    assert not finishing.is_alive()
    assert store.get_request("made-1") is None, "the late write did not outlive the request"
    assert table.get("made-1") is None


def test_a_prompt_counts_as_queued_work_only_until_its_first_token():
    table = RequestTable(InMemoryStore(), ttl_s=60)
    # prefilled on its decode pod, 300 of its 400 tokens expected from the pod's prefix cache
    local = table.admit(RequestRecord("local", "pod-a:1"), 400, cached_tokens=300)
    # prefilled by a chain, which pushes the KV to its decode pod
    chained = table.admit(RequestRecord("chained", "pod-a:1", chain_id="c0",
                                        prefill_address="chain:1"), 900)
    in_flight = table.in_flight()
    assert in_flight["pod-a:1"] == InFlight(requests=2, prompt_tokens=100)
    assert in_flight["chain:1"] == InFlight(requests=1, prompt_tokens=900)

    chained.chain_done = True  # its KV has been pushed: the chain is free of it
    local.prefilled = True  # its first token came: it only decodes now
    in_flight = table.in_flight()
    assert in_flight["pod-a:1"] == InFlight(requests=2, prompt_tokens=0)
    assert "chain:1" not in in_flight
    table.finish("local")
    table.finish("chained")
    assert table.in_flight() == {}
