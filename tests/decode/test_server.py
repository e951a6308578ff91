"""The decode server over real gRPC on port 0: equivalence with the monolithic engine, every
bad input's status code, abort and cancellation freeing the KV, health and routing."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from baton.api import convert
from baton.api.v1 import common_pb2, decode_pb2
from baton.config import StreamConfig
from baton.routing import InMemoryStore
from baton.serving import free_port
from baton.transfer import framing
from baton.transfer.codec import Checksum
from baton.transfer.handoff import FirstToken
from decode_servers import (
    MAX_TOKENS,
    PROMPT,
    collect,
    decode_stub,
    prefilled_handoff,
    proto_messages,
    push,
    start_decode_server,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc


def generate_request(request_id, prompt=PROMPT, **sampling):
    fields = {"temperature": 0.0, "max_tokens": MAX_TOKENS} | sampling
    return decode_pb2.DecodeGenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                            sampling=common_pb2.SamplingParams(**fields))


def wait_until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        result = call()
        if not isinstance(result, decode_pb2.PushKVResponse | common_pb2.AbortResponse):
            list(result)
    return error.value.code(), error.value.details()


# --- equivalence ---------------------------------------------------------------------------


def test_generate_streams_the_monolithic_engines_tokens(stub, reference):
    tokens, messages = collect(stub.Generate(generate_request("local-1"), timeout=30))
    assert tokens == reference
    last = messages[-1]
    assert last.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
    assert all(m.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert last.usage.prompt_tokens == len(PROMPT)
    assert last.usage.completion_tokens == len(reference)
    assert last.timings.ttft_s > 0 and last.timings.total_s >= last.timings.ttft_s


def test_a_stream_interval_sends_fewer_messages_and_the_end_does_not_wait(checkpoint, reference):
    # An hour between messages, far longer than the call's deadline: the first token goes at
    # once, every later one rides with the end, and only the end can cut the hold short (a
    # hold the end did not cut would run past the deadline and fail the call).
    server, port = start_decode_server(checkpoint, InMemoryStore(), stream_interval_ms=1000)
    server.servicer.stream_interval_s = 3600.0
    channel, stub = decode_stub(port)
    try:
        tokens, messages = collect(stub.Generate(generate_request("held"), timeout=30))
    finally:
        channel.close()
        server.stop(0)
    assert tokens == reference
    assert [len(m.token_ids) for m in messages] == [1, len(reference) - 1]
    assert messages[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


@pytest.mark.parametrize("interval_ms", [-1.0, float("nan"), 1001.0])
def test_a_bad_stream_interval_is_refused_naming_it(interval_ms):
    with pytest.raises(ValueError, match=f"stream interval_ms must be in 0..1000, got {interval_ms}"):
        StreamConfig(interval_ms=interval_ms)


def test_pushed_cache_then_attach_continues_like_the_monolithic_engine(stub, checkpoint, reference):
    handoff, chunks = prefilled_handoff(checkpoint, "pushed-1", PROMPT, MAX_TOKENS)
    assert len(chunks) > 1  # the payload really arrives in pieces
    reply = push(stub, handoff, chunks)
    assert reply.request_id == "pushed-1"
    assert reply.bytes_received == handoff.kv.total_bytes
    tokens, messages = collect(stub.Attach(decode_pb2.AttachRequest(request_id="pushed-1"),
                                           timeout=30))
    # The chain's first token came on the push's header: Attach streams it with the rest.
    assert tokens == reference
    assert tokens[0] == handoff.first_token_id
    usage = messages[-1].usage
    assert usage.kv_bytes_shipped == handoff.kv.total_bytes
    assert usage.kv_tokens_kept == usage.kv_tokens_full == len(PROMPT) * handoff.kv.num_layers


def test_attach_may_come_before_the_push(stub, server, checkpoint, reference):
    handoff, chunks = prefilled_handoff(checkpoint, "early-attach", PROMPT, MAX_TOKENS)
    stream = stub.Attach(decode_pb2.AttachRequest(request_id="early-attach", wait_s=20), timeout=30)
    wait_until(lambda: server.servicer.attaches_waiting == 1)  # it waits on the server
    push(stub, handoff, chunks)
    tokens, _ = collect(stream)
    assert tokens == reference


# --- bad input: a status code naming the value, and the server keeps serving -----------------


@pytest.mark.parametrize(("request_fields", "code", "named"), [
    ({"prompt": [1, 2, 300]}, grpc.StatusCode.INVALID_ARGUMENT, "300"),
    ({"prompt": []}, grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ({"temperature": -0.5}, grpc.StatusCode.INVALID_ARGUMENT, "-0.5"),
    ({"temperature": float("nan")}, grpc.StatusCode.INVALID_ARGUMENT, "nan"),
    ({"top_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "1.5"),
    ({"max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ({"max_tokens": 2000}, grpc.StatusCode.INVALID_ARGUMENT, "1024"),
])
def test_bad_generate_requests_get_invalid_argument(stub, reference, request_fields, code, named):
    prompt = request_fields.pop("prompt", PROMPT)
    got, details = status_of(lambda: stub.Generate(generate_request("bad", prompt, **request_fields),
                                                   timeout=10))
    assert got == code
    assert named in details
    tokens, _ = collect(stub.Generate(generate_request("after-bad"), timeout=30))
    assert tokens == reference


def test_duplicate_live_request_id_is_already_exists(stub):
    first = stub.Generate(generate_request("twice", max_tokens=200), timeout=30)
    next(first)  # it is live now
    code, details = status_of(lambda: stub.Generate(generate_request("twice"), timeout=10))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "twice" in details
    first.cancel()


def test_an_aborted_ids_next_generate_waits_for_it_to_leave(stub, reference):
    # As the gateway does after a chain failed a request: abort the id here, then prefill
    # the prompt under the same id; the second call waits for the first to leave the engine.
    first = stub.Generate(generate_request("again", max_tokens=200), timeout=30)
    next(first)
    assert stub.Abort(common_pb2.AbortRequest(request_id="again"), timeout=10).found
    tokens, _ = collect(stub.Generate(generate_request("again"), timeout=30))
    assert tokens == reference
    assert list(first)[-1].finish_reason == common_pb2.FINISH_REASON_ABORTED


def _header(handoff, **changes):
    return dataclasses.replace(handoff, kv=dataclasses.replace(handoff.kv, **changes))


@pytest.mark.parametrize(("change", "code", "named"), [
    # the KV contract's words, the rule the gateway's routing applies (baton.kv.contract)
    ({"model_id": "other-model"}, grpc.StatusCode.FAILED_PRECONDITION, "model 'other-model' != "),
    ({"num_kv_heads": 2}, grpc.StatusCode.FAILED_PRECONDITION, "num kv heads 2 != "),
    ({"dtype": "float16"}, grpc.StatusCode.FAILED_PRECONDITION, "kv dtype float16 != float32"),
    ({"total_bytes": 123}, grpc.StatusCode.INVALID_ARGUMENT, "123"),
])
def test_pushed_cache_for_another_model_or_shape_is_refused(stub, server, checkpoint, change,
                                                            code, named):
    handoff, chunks = prefilled_handoff(checkpoint, "bad-push", PROMPT, MAX_TOKENS)
    # Requests of earlier tests (a cancelled one frees its blocks on the engine's next step)
    # must be gone, or the free count moves under this test.
    wait_until(lambda: not server.worker.engine.has_unfinished())
    free = server.worker.engine.pool.num_free_blocks
    got, details = status_of(lambda: push(stub, _header(handoff, **change), chunks))
    assert got == code and named in details
    assert server.worker.engine.pool.num_free_blocks == free  # nothing was allocated


def test_truncated_push_is_data_loss_and_leaves_nothing(stub, server, checkpoint, reference):
    handoff, chunks = prefilled_handoff(checkpoint, "truncated", PROMPT, MAX_TOKENS)
    code, details = status_of(lambda: push(stub, handoff, chunks[:-1]))
    assert code == grpc.StatusCode.DATA_LOSS and "ended after" in details
    # The Attach that comes for it learns that the push was lost (the gateway prefills the
    # request elsewhere), naming the push's own failure.
    code, details = status_of(lambda: stub.Attach(decode_pb2.AttachRequest(request_id="truncated",
                                                                          wait_s=5), timeout=10))
    assert code == grpc.StatusCode.DATA_LOSS and "ended after" in details and "truncated" in details
    # The same id can be pushed whole afterwards.
    push(stub, handoff, chunks)
    tokens, _ = collect(stub.Attach(decode_pb2.AttachRequest(request_id="truncated"), timeout=30))
    assert tokens == reference


def test_a_push_whose_bytes_do_not_match_its_checksum_is_data_loss(stub, server, checkpoint):
    handoff, chunks = prefilled_handoff(checkpoint, "bad-checksum", PROMPT, MAX_TOKENS)
    free = server.worker.engine.pool.num_free_blocks
    *messages, trailer = proto_messages(handoff, chunks)
    trailer.trailer.checksum ^= 1
    code, details = status_of(lambda: stub.PushKV(iter([*messages, trailer]), timeout=30))
    assert code == grpc.StatusCode.DATA_LOSS and "checksum" in details
    # blocks the cache landed in go back through the engine's inbox
    wait_until(lambda: server.worker.engine.pool.num_free_blocks == free)


def _header_then_break(handoff, chunks, header_seen):
    """A PushKV whose sender dies half way: the header and some bytes, then an error."""
    messages = proto_messages(handoff, chunks)
    yield next(messages)
    header_seen.wait(10)
    yield next(messages)
    raise RuntimeError("the chain's tail died")


def test_an_attached_stream_has_the_first_token_at_the_header_and_data_loss_if_the_push_breaks(
        stub, server, checkpoint):
    handoff, chunks = prefilled_handoff(checkpoint, "broken-push", PROMPT, MAX_TOKENS)
    free = server.worker.engine.pool.num_free_blocks
    attach = stub.Attach(decode_pb2.AttachRequest(request_id="broken-push", wait_s=20), timeout=30)
    header_seen = threading.Event()
    pushing = threading.Thread(target=lambda: status_of(
        lambda: stub.PushKV(_header_then_break(handoff, chunks, header_seen), timeout=30)))
    pushing.start()
    first = next(attach)  # before the payload: the push is held until this arrives
    header_seen.set()
    assert list(first.token_ids) == [handoff.first_token_id]
    with pytest.raises(grpc.RpcError) as error:
        list(attach)
    pushing.join(30)
    assert error.value.code() == grpc.StatusCode.DATA_LOSS  # the gateway moves it on, any pod
    assert "broken-push" in error.value.details()
    wait_until(lambda: server.worker.engine.pool.num_free_blocks == free)


class LandingSpy:
    """Counts the pool's landings and what it stores, and sets ``claimed`` once the engine
    has claimed a landing's blocks (the receiver lands what comes after), passing every
    call on."""

    def __init__(self, worker, monkeypatch) -> None:
        self.landings, self.stored = [], []
        self.claimed = threading.Event()
        pool = worker.engine.pool
        land, store, ask = pool.land, pool.store, worker.land

        def spy_land(*args):
            self.landings.append(land(*args))
            return self.landings[-1]

        def spy_store(seq_id, layers):
            self.stored.append((seq_id, {type(layer).__name__ for layer in layers}))
            return store(seq_id, layers)

        def spy_ask(handoff):
            future = ask(handoff)
            if future is not None:
                future.add_done_callback(lambda _: self.claimed.set())
            return future

        monkeypatch.setattr(pool, "land", spy_land)
        monkeypatch.setattr(pool, "store", spy_store)
        monkeypatch.setattr(worker, "land", spy_ask)


def _after_landing(messages, spy):
    """The header and the first chunk, then the rest once the engine has claimed the
    landing (the receiver takes it at the next message)."""
    yield next(messages)
    yield next(messages)
    assert spy.claimed.wait(20)
    yield from messages


def test_a_pushed_cache_lands_in_the_pools_blocks_as_it_arrives(stub, server, checkpoint,
                                                                reference, monkeypatch):
    spy = LandingSpy(server.worker, monkeypatch)
    handoff, chunks = prefilled_handoff(checkpoint, "landed", PROMPT, MAX_TOKENS)
    stub.PushKV(_after_landing(proto_messages(handoff, chunks), spy), timeout=30)
    tokens, _ = collect(stub.Attach(decode_pb2.AttachRequest(request_id="landed"), timeout=30))
    assert tokens == reference
    assert len(spy.landings) == 1 and spy.stored == [("landed", {"LandedLayer"})]
    assert server.worker.metrics.kv_pushes_landed._value.get() >= 1


def test_a_push_that_breaks_after_landing_gives_its_blocks_back(stub, server, checkpoint,
                                                                monkeypatch):
    spy = LandingSpy(server.worker, monkeypatch)
    handoff, chunks = prefilled_handoff(checkpoint, "landed-broken", PROMPT, MAX_TOKENS)
    free = server.worker.engine.pool.num_free_blocks

    def breaking():
        yield from itertools.islice(_after_landing(proto_messages(handoff, chunks), spy), 4)
        raise RuntimeError("the chain's tail died")

    code, _ = status_of(lambda: stub.PushKV(breaking(), timeout=30))
    assert code != grpc.StatusCode.OK and len(spy.landings) == 1
    wait_until(lambda: server.worker.engine.pool.num_free_blocks == free)
    assert spy.stored == []


def test_push_with_a_bad_first_token_or_no_header(stub, checkpoint):
    handoff, chunks = prefilled_handoff(checkpoint, "bad-first", PROMPT, MAX_TOKENS)
    code, details = status_of(lambda: push(stub, dataclasses.replace(handoff, first_token_id=999),
                                           chunks))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "999" in details
    only_chunks = iter([decode_pb2.PushKVRequest(chunk=b"x")])
    code, _ = status_of(lambda: stub.PushKV(only_chunks, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_request_ids_are_not_found(stub):
    code, details = status_of(lambda: stub.Attach(decode_pb2.AttachRequest(request_id="nobody",
                                                                         wait_s=0.1), timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND and "nobody" in details
    code, details = status_of(lambda: stub.Abort(common_pb2.AbortRequest(request_id="nobody"),
                                                timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND and "nobody" in details


def test_a_full_pool_refuses_a_push_at_once(checkpoint):
    server, port = start_decode_server(checkpoint, num_blocks=6)  # 2 blocks per layer: 8 tokens
    channel, stub = decode_stub(port)
    try:
        handoff, chunks = prefilled_handoff(checkpoint, "too-big", PROMPT, MAX_TOKENS)
        code, details = status_of(lambda: push(stub, handoff, chunks))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "6 free" in details
    finally:
        channel.close()
        server.stop(0)


# --- abort, cancellation, load ------------------------------------------------------------


def test_abort_mid_stream_returns_the_pool_to_its_free_blocks(stub, server):
    wait_until(lambda: server.worker.load.running_sequences == 0)
    initial = stub.Stats(common_pb2.StatsRequest(), timeout=10).free_kv_blocks
    stream = stub.Generate(generate_request("to-abort", max_tokens=500), timeout=30)
    next(stream)
    # the load the pod publishes after the step that streamed the token
    wait_until(lambda: stub.Stats(common_pb2.StatsRequest(), timeout=10).free_kv_blocks < initial)
    assert stub.Abort(common_pb2.AbortRequest(request_id="to-abort"), timeout=10).found
    messages = list(stream)
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_ABORTED
    load = stub.Stats(common_pb2.StatsRequest(), timeout=10)
    assert load.free_kv_blocks == initial == load.total_kv_blocks
    assert load.running_sequences == 0


def test_a_cancelled_call_frees_its_kv(stub, server):
    wait_until(lambda: server.worker.load.running_sequences == 0)
    initial = server.worker.load.free_kv_blocks
    stream = stub.Generate(generate_request("to-cancel", max_tokens=500), timeout=30)
    next(stream)
    stream.cancel()
    wait_until(lambda: server.worker.load.free_kv_blocks == initial
               and server.worker.load.running_sequences == 0)


def test_health_serving_and_registered_with_live_load(server, store):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "baton.v1.Decode"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()
    [worker] = store.list_workers("decode")
    assert worker.address == server.address
    assert worker.load.total_kv_blocks == server.worker.engine.pool.num_blocks
    assert convert.worker_load_to_proto(worker.load).total_kv_blocks > 0


def test_stop_deregisters_and_reports_not_serving(checkpoint):
    store = InMemoryStore()
    server, port = start_decode_server(checkpoint, store)
    assert len(store.list_workers("decode")) == 1
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    server.grpc.set_serving(False)
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    channel.close()
    server.stop(0)
    assert store.list_workers("decode") == []


def test_metrics_and_health_are_served_over_http_when_a_port_is_given(checkpoint):
    metrics_port = free_port()
    server, port = start_decode_server(checkpoint, metrics_port=metrics_port)
    channel, stub = decode_stub(port)
    try:
        collect(stub.Generate(generate_request("measured"), timeout=30))
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                      timeout=10).read().decode()
        assert urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=10).status == 200
        server.grpc.set_serving(False)  # what a draining pod says: probes see it too
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=10)
        assert error.value.code == 503
    finally:
        channel.close()
        server.stop(0)
    assert "baton_decode_time_to_first_token_seconds_count 1.0" in text
    assert 'baton_decode_requests_finished_total{reason="length"} 1.0' in text
    assert f"baton_decode_kv_blocks_total {server.worker.engine.pool.num_blocks}.0" in text


@pytest.mark.parametrize("wait_s", [float("nan"), float("inf"), -1.0, 601.0])
def test_an_attach_wait_that_is_not_a_bounded_number_of_seconds_is_invalid(stub, wait_s):
    code, details = status_of(lambda: stub.Attach(decode_pb2.AttachRequest(
        request_id="late", wait_s=wait_s), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and str(wait_s) in details


def test_attach_callers_that_give_up_do_not_keep_the_servers_threads(stub):
    # More waiting Attach calls than the server has handler threads, each abandoned by its
    # caller after 0.3 s: their handlers must return, so that other calls are served.
    calls = [stub.Attach(decode_pb2.AttachRequest(request_id=f"never-{i}", wait_s=60), timeout=0.3)
             for i in range(80)]
    for call in calls:
        with pytest.raises(grpc.RpcError) as error:
            list(call)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    started = time.monotonic()
    stub.Stats(common_pb2.StatsRequest(), timeout=5)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("ending", ["max_tokens=1", "first token is a stop token"])
def test_a_pushed_request_that_ends_at_its_first_token_is_still_attached_at_once(stub, server,
                                                                                checkpoint, ending):
    # The chain's first token is the whole answer (max_tokens 1, or it is a stop token), so
    # the pod finishes the request as the cache arrives, before any Attach; the Attach must
    # get its end at once, not wait for a cache that already came.
    request_id = f"first-ends-{ending.split()[0]}"
    handoff, chunks = prefilled_handoff(checkpoint, request_id, PROMPT,
                                        1 if ending == "max_tokens=1" else MAX_TOKENS)
    if ending != "max_tokens=1":
        handoff = dataclasses.replace(handoff, sampling=dataclasses.replace(
            handoff.sampling, stop_token_ids=[handoff.first_token_id]))
    push(stub, handoff, chunks)
    wait_until(lambda: not server.worker.engine.has_unfinished())  # admitted and finished
    started = time.monotonic()
    tokens, messages = collect(stub.Attach(decode_pb2.AttachRequest(request_id=request_id, wait_s=20),
                                           timeout=30))
    assert time.monotonic() - started < 5
    reason = common_pb2.FINISH_REASON_LENGTH if ending == "max_tokens=1" else common_pb2.FINISH_REASON_STOP
    assert tokens == [handoff.first_token_id] and messages[-1].finish_reason == reason


def _header_then_stall(handoff, release):
    """A PushKV that sends its header and then nothing until ``release`` is set."""
    yield next(iter(proto_messages(handoff, [])))
    release.wait(60)


def test_a_push_that_stalls_after_its_header_is_cut_off_and_frees_nothing(stub, server, checkpoint,
                                                                           monkeypatch):
    from baton.transfer import receiver
    monkeypatch.setattr(receiver, "STALL_S", 0.5)
    handoff, _ = prefilled_handoff(checkpoint, "stalled", PROMPT, MAX_TOKENS)
    free = server.worker.engine.pool.num_free_blocks
    release = threading.Event()
    try:
        code, details = status_of(lambda: stub.PushKV(_header_then_stall(handoff, release), timeout=20))
    finally:
        release.set()
    assert code == grpc.StatusCode.DATA_LOSS and "stalled" in details and "0.5 s" in details
    assert server.worker.engine.pool.num_free_blocks == free


def test_stalled_pushes_and_waiting_attaches_do_not_hold_up_a_generate(stub, checkpoint, reference):
    # More stalled uploads and waiting Attach calls than a thread-per-call server had
    # threads: a streamed request beside them is served at its usual pace.
    handoff, _ = prefilled_handoff(checkpoint, "stall-many", PROMPT, MAX_TOKENS)
    release = threading.Event()
    pushes = [stub.PushKV.future(_header_then_stall(_header(handoff, request_id=f"s{i}"),
                                                    release), timeout=30) for i in range(60)]
    attaches = [stub.Attach(decode_pb2.AttachRequest(request_id=f"w{i}", wait_s=30), timeout=30)
                for i in range(80)]
    try:
        started = time.monotonic()
        tokens, _ = collect(stub.Generate(generate_request("beside-stalls"), timeout=20))
        assert tokens == reference
        assert time.monotonic() - started < 10
    finally:
        release.set()
        for call in attaches:
            call.cancel()
    for future in pushes:  # released: each upload ended without its chunks
        with pytest.raises(grpc.RpcError) as error:
            future.result()
        assert error.value.code() == grpc.StatusCode.DATA_LOSS


def test_pushed_kv_that_nobody_attaches_to_is_freed_after_its_lease(checkpoint):
    server, port = start_decode_server(checkpoint, lease_s=0.3)
    channel, stub = decode_stub(port)
    try:
        free = server.worker.engine.pool.num_free_blocks
        handoff, chunks = prefilled_handoff(checkpoint, "orphan", PROMPT, 900)
        push(stub, handoff, chunks)  # ... and its caller never attaches
        wait_until(lambda: server.worker.metrics.kv_leases_expired._value.get() == 1, 10)
        wait_until(lambda: server.worker.engine.pool.num_free_blocks == free, 10)
        code, _ = status_of(lambda: stub.Attach(decode_pb2.AttachRequest(request_id="orphan",
                                                                        wait_s=0.2), timeout=10))
        assert code == grpc.StatusCode.NOT_FOUND
    finally:
        channel.close()
        server.stop(0)


def test_uploads_beyond_the_limit_are_resource_exhausted_at_once(checkpoint):
    server, port = start_decode_server(checkpoint, max_pending_pushes=4)
    channel, stub = decode_stub(port)
    handoff, _ = prefilled_handoff(checkpoint, "limit", PROMPT, MAX_TOKENS)
    release = threading.Event()
    try:
        stalled = [stub.PushKV.future(_header_then_stall(_header(handoff, request_id=f"l{i}"), release),
                                      timeout=30) for i in range(4)]
        wait_until(lambda: server.servicer.pushes_in_progress == 4)
        code, details = status_of(lambda: stub.PushKV(_header_then_stall(
            _header(handoff, request_id="one-too-many"), release), timeout=10))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "4 KV uploads" in details
        release.set()
        for future in stalled:
            with pytest.raises(grpc.RpcError):
                future.result()
        wait_until(lambda: server.servicer.pushes_in_progress == 0)
    finally:
        release.set()
        channel.close()
        server.stop(0)


def test_work_meant_for_another_incarnation_of_this_address_is_refused(stub, server, store, checkpoint,
                                                                        reference):
    # A pod restarted on the same address is a new incarnation: a route, an Attach or a KV
    # push made for its predecessor gets FAILED_PRECONDITION naming both, not a stranger's work.
    mine = server.incarnation
    (record,) = [w for w in store.list_workers("decode") if w.address == server.address]
    assert record.incarnation == mine and len(mine) == 16
    old_route = generate_request("old-route")
    old_route.incarnation = "0" * 16
    code, details = status_of(lambda: stub.Generate(old_route, timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "0" * 16 in details and mine in details
    code, _ = status_of(lambda: stub.Attach(decode_pb2.AttachRequest(
        request_id="old-attach", wait_s=1, incarnation="0" * 16), timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    handoff, chunks = prefilled_handoff(checkpoint, "old-push", PROMPT, MAX_TOKENS)
    free = server.worker.engine.pool.num_free_blocks
    code, details = status_of(lambda: push(stub, dataclasses.replace(handoff, decode_incarnation="0" * 16),
                                           chunks))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "old-push" in details
    assert server.worker.engine.pool.num_free_blocks == free
    # naming this incarnation (or none) is served
    request = generate_request("this-route")
    request.incarnation = mine
    tokens, _ = collect(stub.Generate(request, timeout=30))
    assert tokens == reference


# --- a push whose first token follows its header (the tail ships layer by layer) ----------


def layer_by_layer(handoff, chunks, first=None, before_first=lambda: None, trailer=True):
    """The push as a tail shipping by layer sends it: the header (its first token to follow),
    the payload, the first token before the last chunk, the trailer."""
    follows = dataclasses.replace(handoff, first_token_id=0, prefill_s=0.0, partition=(),
                                  first_token_follows=True)
    yield decode_pb2.PushKVRequest(header=framing.handoff_to_proto(follows))
    checksum = Checksum()
    for index, chunk in enumerate(chunks):
        if index == len(chunks) - 1 and first is not None:
            before_first()
            yield decode_pb2.PushKVRequest(first_token=framing.first_token_to_proto(first))
        checksum.update(chunk)
        yield decode_pb2.PushKVRequest(chunk=chunk)
    if trailer:
        yield decode_pb2.PushKVRequest(trailer=decode_pb2.PushKVTrailer(checksum=checksum.value))


def test_a_first_token_that_follows_streams_when_it_comes_and_the_rest_equals_the_engine(
        stub, server, checkpoint, reference, monkeypatch):
    spy = LandingSpy(server.worker, monkeypatch)
    handoff, chunks = prefilled_handoff(checkpoint, "by-layer-1", PROMPT, MAX_TOKENS)
    attach = stub.Attach(decode_pb2.AttachRequest(request_id="by-layer-1", wait_s=20), timeout=30)
    layers_out, first_may_go = threading.Event(), threading.Event()

    def before_first():
        layers_out.set()
        assert first_may_go.wait(20)

    first = FirstToken(handoff.first_token_id, 0.5, (0, 7, len(PROMPT)))
    pushing = threading.Thread(target=lambda: stub.PushKV(
        layer_by_layer(handoff, chunks, first, before_first), timeout=30))
    pushing.start()
    assert layers_out.wait(20)
    with ThreadPoolExecutor(1) as reader:
        reading = reader.submit(lambda: next(attach))
        # the header and payload are on the pod (the engine claimed their blocks) and the
        # first token is held back: no token yet (one sent early would also break the
        # equality below, the header's placeholder being 0)
        assert spy.claimed.wait(20)
        assert not reading.done()
        first_may_go.set()
        tokens = list(reading.result(20).token_ids)
    more, messages = collect(attach)
    pushing.join(30)
    assert tokens + more == reference
    assert list(messages[-1].route.partition) == [0, 7, len(PROMPT)]


@pytest.mark.parametrize("case, named", [("unannounced", "did not announce"),
                                         ("missing", "without the first token"),
                                         ("outside the vocabulary", "999")])
def test_a_first_token_out_of_turn_or_of_range_is_invalid(stub, server, checkpoint, case, named):
    handoff, chunks = prefilled_handoff(checkpoint, f"by-layer-{case}", PROMPT, MAX_TOKENS)
    free = server.worker.engine.pool.num_free_blocks
    if case == "unannounced":  # a header with its token, and a token message after it
        messages = list(proto_messages(handoff, chunks))
        messages.insert(2, decode_pb2.PushKVRequest(
            first_token=framing.first_token_to_proto(FirstToken(handoff.first_token_id))))
    else:
        first = FirstToken(999) if case == "outside the vocabulary" else None
        messages = list(layer_by_layer(handoff, chunks, first))
    code, details = status_of(lambda: stub.PushKV(iter(messages), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and named in details
    wait_until(lambda: server.worker.engine.pool.num_free_blocks == free)

