"""The whole service as real processes on localhost (gateway, a 2-rank prefill chain, two
decode pods, a real redis-server): both request paths equal the monolithic engine, many
clients at once, abort and cancellation free the KV, bad input gets its code, and routing
survives dead workers and a Redis outage. One cluster serves the module, in this order."""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from baton.api.requests import CompressionParams, FinishReason, GenerateRequest
from baton.api.v1 import api_pb2, common_pb2
from baton.client import BatonClient
from baton.routing.redis_store import RedisStore
from baton.sampling.params import SamplingParams
from e2e_cluster import (
    CHAIN_THRESHOLD_TOKENS,
    WORKER_TTL_S,
    all_kv_free,
    decode_addresses,
    greedy,
    long_prompt_ids,
    wait_until,
    worker_load,
)

pytestmark = pytest.mark.slow
SHORT_PROMPT = "import os\n\ndef main():\n"
NO_COMPRESSION = CompressionParams(enabled=False)




def test_a_short_prompt_is_prefilled_on_a_decode_pod_and_equals_the_monolithic_engine(client, reference):
    prompt_ids = reference.tokenizer.encode(SHORT_PROMPT)
    completion = client.generate(GenerateRequest(text=SHORT_PROMPT, sampling=greedy(12)))
    assert completion.token_ids == reference.tokens(prompt_ids, 12)
    assert completion.text == reference.tokenizer.decode(completion.token_ids)
    last = completion.last
    assert last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert last.route.chain_id == "" and last.route.decode_address
    assert last.usage.prompt_tokens == len(prompt_ids) and last.usage.kv_bytes_shipped == 0
    assert 0 < last.timings.ttft_s <= last.timings.total_s


def test_a_long_prompt_goes_through_the_chain_and_equals_the_monolithic_engine(client, reference):
    prompt_ids = long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 72)
    # pinned: the automatic route may find the prompt's start cached on a decode pod
    completion = client.generate(GenerateRequest(token_ids=tuple(prompt_ids), sampling=greedy(12),
                                                 compression=NO_COMPRESSION, prefill_route="chain"))
    assert completion.token_ids == reference.tokens(prompt_ids, 12)
    route, usage = completion.last.route, completion.last.usage
    assert route.chain_id == "chain-0"
    assert route.partition[0] == 0 and route.partition[-1] == len(prompt_ids) and len(route.partition) == 3
    assert usage.kv_bytes_shipped > 0 and usage.kv_tokens_kept == usage.kv_tokens_full
    assert completion.last.timings.kv_push_s > 0


def test_a_long_prompt_with_compression_ships_less_and_still_completes_sensibly(client, reference):
    prompt_ids = long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 200)
    compressed = client.generate(GenerateRequest(
        token_ids=tuple(prompt_ids), sampling=greedy(16),
        compression=CompressionParams(enabled=True, keep_ratio=0.5)))
    usage = compressed.last.usage
    assert usage.kv_tokens_kept < 0.8 * usage.kv_tokens_full
    full = reference.tokens(prompt_ids, 16)
    # The first token comes from the tail's full attention; what follows attends to half the
    # cache and should still mostly agree with the uncompressed continuation.
    assert compressed.token_ids[0] == full[0]
    agreement = sum(a == b for a, b in zip(compressed.token_ids, full)) / len(full)
    assert agreement >= 0.5, (compressed.text, reference.tokenizer.decode(full))


def test_sixteen_concurrent_streaming_clients_all_complete(cluster, reference):
    long_ids = long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 10)
    long_ids = tuple(long_ids[7:] + long_ids[:7])  # a start no earlier request had: not cached
    requests = [GenerateRequest(token_ids=long_ids, sampling=greedy(6)) if i % 4 == 0 else
                GenerateRequest(text=f"{SHORT_PROMPT}    x = {i}\n", sampling=greedy(4 + i % 5))
                for i in range(16)]
    results: dict[int, object] = {}

    def run(index: int) -> None:
        client = BatonClient(cluster.gateway_address)
        try:
            results[index] = client.generate(requests[index], timeout_s=120)
        except grpc.RpcError as e:
            results[index] = e
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = {i: r for i, r in results.items() if isinstance(r, grpc.RpcError)}
    assert not errors, errors
    for index, completion in results.items():
        assert completion.last.usage.completion_tokens == len(completion.token_ids) > 0
        assert len(completion.token_ids) <= requests[index].sampling.max_tokens
    used_pods = {completion.last.route.decode_address for completion in results.values()}
    assert len(used_pods) == 2, "the burst spreads over both decode pods"
    assert any(completion.last.route.chain_id for completion in results.values())


@pytest.mark.parametrize("path", ["local", "chain"])
def test_abort_mid_stream_ends_the_stream_and_frees_the_kv_everywhere(cluster, client, reference, path):
    prompt = (tuple(long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 50))
              if path == "chain" else tuple(reference.tokenizer.encode(SHORT_PROMPT)))
    request = GenerateRequest(request_id=f"abort-{path}", token_ids=prompt,
                              sampling=SamplingParams(temperature=0.0, max_tokens=600,
                                                      stop_token_ids=[]))
    steps, aborted = [], False
    for step in client.stream(request):
        steps.append(step)
        if not aborted and sum(len(s.token_ids) for s in steps) >= 3:
            aborted = client.abort(request.request_id)
            assert aborted
    assert steps[-1].finish_reason is FinishReason.ABORTED
    assert sum(len(s.token_ids) for s in steps) < 600
    wait_until(lambda: all_kv_free(cluster), 10, "the decode pods to free the aborted KV")
    chain_head = cluster_chain_address(cluster)
    wait_until(lambda: worker_load(cluster, chain_head, "prefill").queued_requests == 0, 10,
               "the chain to drop the request")
    assert not client.abort(request.request_id), "nothing is left to abort"


@pytest.mark.parametrize("path", ["local", "chain"])
def test_the_store_holds_a_request_the_gateway_named_by_its_first_step(cluster, client,
                                                                        reference, path):
    # The gateway writes the record of an id it made while the request runs: by the step
    # that tells the client the id, another gateway replica must find the request.
    prompt = (tuple(long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 50))
              if path == "chain" else tuple(reference.tokenizer.encode(SHORT_PROMPT)))
    store = RedisStore(cluster.redis_url)
    try:
        # 64 tokens: a 4-token request could end, and its record go, before the first step
        # is read here (a decode step takes a few ms)
        stream = iter(client.stream(GenerateRequest(token_ids=prompt, prefill_route=path,
                                                    sampling=greedy(64))))
        first = next(stream)
        record = store.get_request(first.request_id)
        assert record is not None and record.decode_address in decode_addresses(cluster)
        assert bool(record.chain_id) == (path == "chain")
        assert list(stream)[-1].finish_reason is not None
        wait_until(lambda: store.get_request(first.request_id) is None, 10,
                   "the finished request's record to go")
    finally:
        store.close()


def cluster_chain_address(cluster) -> str:
    store = RedisStore(cluster.redis_url)
    try:
        (head,) = [w for w in store.list_workers("prefill") if w.rank == 0]
        return head.address
    finally:
        store.close()


def test_a_client_that_cancels_frees_the_kv_on_the_decode_pod(cluster, client, reference):
    stream = client.stream(GenerateRequest(text=SHORT_PROMPT, sampling=SamplingParams(
        temperature=0.0, max_tokens=600)))
    received = 0
    with pytest.raises(grpc.RpcError) as error:
        for step in stream:
            received += len(step.token_ids)
            if received >= 3:
                stream.cancel()
    assert error.value.code() == grpc.StatusCode.CANCELLED
    wait_until(lambda: all_kv_free(cluster), 10, "the decode pod to free a cancelled request")


def raw(**fields) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(**fields)


def bad_requests(vocab_size: int, max_model_len: int) -> list:
    """(message, code, words of the message) for each kind of bad input, sized to the model."""
    too_long = max_model_len - 50
    return [
        (raw(text=""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (raw(text="x", sampling=common_pb2.SamplingParams(max_tokens=0)),
         grpc.StatusCode.INVALID_ARGUMENT, "got 0"),
        (raw(text="x", sampling=common_pb2.SamplingParams(temperature=math.nan)),
         grpc.StatusCode.INVALID_ARGUMENT, "nan"),
        (raw(text="x", sampling=common_pb2.SamplingParams(top_p=0.0)),
         grpc.StatusCode.INVALID_ARGUMENT, "got 0.0"),
        (raw(token_ids=api_pb2.TokenIds(ids=[5, vocab_size])), grpc.StatusCode.INVALID_ARGUMENT,
         f"[{vocab_size}]"),
        (raw(text="x", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "'gpt-9'"),
        (raw(token_ids=api_pb2.TokenIds(ids=[5] * too_long),
             sampling=common_pb2.SamplingParams(max_tokens=100)),
         grpc.StatusCode.INVALID_ARGUMENT,
         f"{too_long + 100} exceeds the model's limit of {max_model_len}"),
    ]


def test_each_bad_input_gets_its_code_and_the_service_keeps_serving(client):
    (model,) = client.list_models()
    for message, code, words in bad_requests(model.vocab_size, model.max_model_len):
        with pytest.raises(grpc.RpcError) as error:
            list(client.stub.Generate(message, timeout=10))
        assert error.value.code() == code and words in error.value.details(), message
    first = client.stream(GenerateRequest(request_id="twice", text=SHORT_PROMPT,
                                          sampling=SamplingParams(temperature=0, max_tokens=200)))
    next(iter(first))
    with pytest.raises(grpc.RpcError) as error:
        list(client.stream(GenerateRequest(request_id="twice", text="x")))
    assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
    assert client.generate(GenerateRequest(text=SHORT_PROMPT, sampling=greedy(3))).token_ids


def test_hostile_requests_beside_a_small_one_do_not_hold_it_up(client, reference):
    # Three 15 MB prompts (refused before tokenizing) and a max_tokens=1 request through the
    # chain, all at once with a 4-token request: the small one completes promptly, the big
    # ones get INVALID_ARGUMENT with their size.
    huge = BatonClient(client.address)
    errors: list[grpc.RpcError] = []

    def send_huge():
        try:
            huge.generate(GenerateRequest(text="x" * (15 << 20), sampling=greedy(4)), timeout_s=60)
        except grpc.RpcError as e:
            errors.append(e)

    senders = [threading.Thread(target=send_huge) for _ in range(3)]
    for sender in senders:
        sender.start()
    started = time.monotonic()
    one_token = client.generate(GenerateRequest(
        token_ids=tuple(long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 20)),
        sampling=greedy(1), compression=NO_COMPRESSION, prefill_route="chain"), timeout_s=30)
    small = client.generate(GenerateRequest(text=SHORT_PROMPT, sampling=greedy(4)), timeout_s=30)
    elapsed_s = time.monotonic() - started
    for sender in senders:
        sender.join(60)
    huge.close()
    assert len(one_token.token_ids) == 1 and one_token.last.route.chain_id
    assert small.token_ids == reference.tokens(reference.tokenizer.encode(SHORT_PROMPT), 4)
    assert elapsed_s < 10
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert "15728640 bytes" in errors[0].details()


def test_generate_with_server_keeps_the_json_contract_of_a_local_run(cluster, reference):
    prompt_ids = reference.tokenizer.encode(SHORT_PROMPT)
    completed = subprocess.run(
        [sys.executable, "-m", "baton.cli", "generate", "--server", cluster.gateway_address,
         "--prompt-ids", ",".join(map(str, prompt_ids)), "--max-tokens", "6", "--json"],
        capture_output=True, text=True, timeout=60, check=False)
    assert completed.returncode == 0, completed.stderr
    expected = reference.tokens(prompt_ids, 6)
    assert json.loads(completed.stdout) == {"token_ids": expected,
                                            "text": reference.tokenizer.decode(expected)}


def test_a_worker_whose_heartbeats_stop_leaves_routing_after_its_ttl(cluster, client):
    paused = cluster.child("decode-1")
    addresses = decode_addresses(cluster)
    assert len(addresses) == 2
    paused.process.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: len(decode_addresses(cluster)) == 1, 3 * WORKER_TTL_S,
                   "the paused pod's record to expire")
        (survivor,) = decode_addresses(cluster)
        for _ in range(4):  # every request now lands on the survivor, none hangs on the paused pod
            completion = client.generate(GenerateRequest(text=SHORT_PROMPT, sampling=greedy(2)),
                                         timeout_s=30)
            assert completion.last.route.decode_address == survivor
    finally:
        paused.process.send_signal(signal.SIGCONT)
    wait_until(lambda: len(decode_addresses(cluster)) == 2, 3 * WORKER_TTL_S,
               "the resumed pod to register again")


def test_the_gateway_serves_through_a_redis_outage_and_finds_new_workers_after(cluster, client):
    # Start from a gateway that routes (earlier tests pause and resume workers).
    wait_until(lambda: _try_generate(client), 30, "the cluster to serve before the outage")
    cluster.redis.stop()
    for _ in range(3):
        assert client.generate(GenerateRequest(text=SHORT_PROMPT, sampling=greedy(2)),
                               timeout_s=30).token_ids
    newcomer = cluster.add_decode_worker()
    cluster.redis.start()
    cluster.redis.wait_ready(10)
    wait_until(lambda: len(decode_addresses(cluster)) == 3, 120, "the new decode pod to register")
    old = [cluster.child("decode-0"), cluster.child("decode-1")]
    for child in old:  # a clean stop deregisters: only the newcomer is left to route to
        child.process.terminate()
    for child in old:
        child.process.wait(30)
    (new_address,) = decode_addresses(cluster)
    completion = wait_until(lambda: _try_generate(client), 10, "a request on the new pod")
    assert completion.last.route.decode_address == new_address
    assert newcomer.process.poll() is None


def _try_generate(client):
    try:
        return client.generate(GenerateRequest(text=SHORT_PROMPT, sampling=greedy(2)), timeout_s=30)
    except grpc.RpcError:
        return None


@pytest.mark.parametrize("path", ["local", "chain"])
def test_a_stream_names_its_request_in_its_first_message_only(client, reference, path):
    prompt = (long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 10) if path == "chain"
              else reference.tokenizer.encode(SHORT_PROMPT))
    request_id = "named-once-" + path + "-" + "x" * 200
    # A reader that falls behind gets the tokens published meanwhile merged into one message;
    # 64 tokens past EOS keep the stream longer than a busy machine's stall.
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    messages = list(client.stub.Generate(raw(request_id=request_id, token_ids=api_pb2.TokenIds(ids=prompt),
                                             sampling=sampling), timeout=30))
    assert len(messages) > 1, "the whole stream came in one message: nothing to check"
    assert messages[0].request_id == request_id
    assert all(message.request_id == "" for message in messages[1:])


def test_a_route_to_an_earlier_incarnation_of_an_address_is_refused_and_moved(cluster, client, reference):
    # A routing record left by a pod that restarted on the same address (here: planted, with
    # the real pod's address, an old incarnation, the lightest load and the fastest prefill
    # rate, so that it is picked over the real pod's record, whose rate moves as it works):
    # the pod refuses the work (FAILED_PRECONDITION), the gateway routes it again, and the
    # client sees nothing of it but its tokens.
    store = RedisStore(cluster.redis_url)
    try:
        real = next(iter(store.list_workers("decode")))
        ghost = dataclasses.replace(real, worker_id="decode-ghost", incarnation="0" * 16,
                                    load=dataclasses.replace(real.load, running_sequences=0,
                                                             queued_requests=0,
                                                             queued_prompt_tokens=0,
                                                             free_kv_blocks=10**6,
                                                             prefill_tokens_per_s=1e9))
        store.register_worker(ghost, ttl_s=30)
        prompt_ids = reference.tokenizer.encode(SHORT_PROMPT)
        refused = f"meant for incarnation '{'0' * 16}'"
        # Until the gateway's view (refreshed every 0.2 s) has the record, requests go to the
        # real pod; every one of them is served either way.
        deadline = time.monotonic() + 20
        while refused not in cluster.child("gateway").log_tail(1_000_000):
            assert time.monotonic() < deadline, "the gateway never routed to the planted record"
            completion = client.generate(GenerateRequest(token_ids=tuple(prompt_ids),
                                                         sampling=greedy(6)), timeout_s=60)
            assert completion.token_ids == reference.tokens(prompt_ids, 6)
    finally:
        store.remove_worker("decode-ghost")
        store.close()
