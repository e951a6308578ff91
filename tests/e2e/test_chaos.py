"""Chaos: the whole service as real processes, supervised as `baton up` supervises it, loses a
decode pod, then a chain rank, then Redis, each while greedy streams are in flight. Every
request completes, every client's tokens equal a fault-free run (the monolithic engine;
greedy requests and four seeded ones),
and the service takes new requests within seconds of each fault.

What keeps the streams whole: the gateway moves a stream whose decode pod died to another
one (prompt + tokens sent replayed; under compression the sent tokens through decode steps, so
the pyramid is the one the stream had), a chain that fails a request hands it to a decode pod
(``recompute``), the gateway routes from its last view while Redis is down, and the
supervisor restarts what died."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from baton.api.requests import CompressionParams, GenerateRequest
from baton.client import BatonClient
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from baton.sampling.params import SamplingParams
from e2e_cluster import (
    CHAIN_THRESHOLD_TOKENS,
    WORKER_TTL_S,
    MonolithicReference,
    greedy,
    skip_without_cluster_parts,
    supervised,
    worker_load,
)

pytestmark = pytest.mark.slow
MAX_TOKENS = 40
BACK_WITHIN_S = 30.0  # the service takes a new request within this long of a fault
NO_COMPRESSION = CompressionParams(enabled=False)


@pytest.fixture(scope="module")
def chaos_cluster(tmp_path_factory):
    skip_without_cluster_parts()
    spec = ClusterSpec(decode_workers=2, chain_ranks=2, prefill_threshold_tokens=CHAIN_THRESHOLD_TOKENS,
                       chain_break_even=False, heartbeat_s=0.5, worker_ttl_s=WORKER_TTL_S)
    with LocalCluster(spec, log_dir=tmp_path_factory.mktemp("chaos-logs")) as cluster, \
            supervised(cluster) as restarts:
        BatonClient(cluster.gateway_address).wait_until_serving(timeout_s=30)
        yield cluster, restarts


def sampling_of(index: int) -> SamplingParams:
    """Greedy, but for four seeded requests (a moved seeded stream continues its draws)."""
    if index < 4:
        return SamplingParams(temperature=0.8, seed=1000 + index, max_tokens=MAX_TOKENS)
    return greedy(MAX_TOKENS)


@pytest.fixture(scope="module")
def reference():
    reference = MonolithicReference()
    return reference, reference.tokenizer.encode(Path(os.__file__).read_text())


def long_prompts(source: list[int], start: int) -> list[list[int]]:
    """16 prompts at least the routing threshold long (a chain's, when no pod has them cached)."""
    return [source[start + i * 53: start + i * 53 + CHAIN_THRESHOLD_TOKENS + 10 * i] for i in range(16)]


@pytest.fixture(scope="module")
def prompts(reference):
    """16 short prompts (prefilled on a decode pod) and 16 long ones (through the chain)."""
    reference, source = reference
    short = [source[i * 37: i * 37 + 20 + i] for i in range(16)]
    everything = short + long_prompts(source, 2000)
    results = reference.engine.generate(everything, [sampling_of(i) for i in range(len(everything))])
    return everything, [result.token_ids for result in results]


@pytest.fixture(scope="module")
def unseen_long_prompts(reference):
    """16 more long prompts, which no test sends before it kills a chain rank: a prompt a decode
    pod has cached would be prefilled there, not by the chain."""
    reference, source = reference
    unseen = long_prompts(source, 6000)
    results = reference.engine.generate(unseen, [greedy(MAX_TOKENS)] * len(unseen))
    return unseen, [result.token_ids for result in results]


class Streams:
    """Every prompt streamed at once through the gateway, each on its own thread."""

    def __init__(self, address: str, prompts: list[list[int]], first_index: int = 0) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.routes: list = [None] * len(prompts)
        self.errors: list[str] = []
        self._first_index = first_index  # index of prompts[0] in the whole list (its sampling)
        self._threads = [threading.Thread(target=self._one, args=(address, i, prompt), daemon=True)
                         for i, prompt in enumerate(prompts)]
        for thread in self._threads:
            thread.start()

    def _one(self, address: str, index: int, prompt: list[int]) -> None:
        client = BatonClient(address)
        try:
            request = GenerateRequest(token_ids=tuple(prompt),
                                      sampling=sampling_of(self._first_index + index),
                                      compression=NO_COMPRESSION)
            for step in client.stream(request, timeout_s=180):
                self.tokens[index] += step.token_ids
                if step.route is not None:
                    self.routes[index] = step.route
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.errors.append(f"request {index}: {e!r}")
        finally:
            client.close()

    def wait_for_tokens(self, at_least: int, streams: int | None = None, timeout_s: float = 60) -> None:
        """Until ``streams`` of them (all by default) have ``at_least`` tokens: the fault
        lands mid-stream."""
        wanted = len(self.tokens) if streams is None else streams
        deadline = time.monotonic() + timeout_s
        while sum(len(tokens) >= at_least for tokens in self.tokens) < wanted and not self.errors:
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.02)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(200)


def serves_a_new_request(address: str) -> float:
    """Seconds until a new request completes."""
    started = time.monotonic()
    client = BatonClient(address)
    try:
        while True:
            try:
                client.generate(GenerateRequest(text="import os\n", sampling=greedy(2)), timeout_s=30)
                return time.monotonic() - started
            except Exception:  # noqa: BLE001 - the service is still recovering
                assert time.monotonic() - started < BACK_WITHIN_S, "the service did not come back"
                time.sleep(0.25)
    finally:
        client.close()


def running_on_each_pod(cluster) -> list[tuple[int, str, str]]:
    """(running sequences, child name, address) of each decode pod, once each answers: a pod
    an earlier test killed may still be coming back under the supervisor (its last start's
    address refuses until then)."""
    deadline = time.monotonic() + 30
    while True:
        pods = []
        try:
            for name in ("decode-0", "decode-1"):
                child = cluster.child(name)
                address = re.findall(r"decode pod (\S+) serves", child.log_path.read_text())[-1]
                pods.append((worker_load(cluster, address, "decode").running_sequences, name, address))
            return pods
        except Exception:  # noqa: BLE001 - not back yet
            assert time.monotonic() < deadline, "a decode pod did not come back"
            time.sleep(0.2)


def kill(process) -> None:
    os.kill(process.pid, signal.SIGKILL)


def test_streams_survive_a_decode_pod_a_chain_rank_and_redis_dying(chaos_cluster, prompts,
                                                                   unseen_long_prompts):
    cluster, restarts = chaos_cluster
    everything, expected = prompts

    # 1. A decode pod dies mid-stream: its streams move to the other pod. The kill comes
    #    once the short streams (on both pods, far from their 40 tokens) are flowing.
    streams = Streams(cluster.gateway_address, everything)
    streams.wait_for_tokens(2, streams=12)
    victim = cluster.child("decode-0")
    # the last start's address (a pod restarted by the supervisor logs a line per start)
    victim_address = re.findall(r"decode pod (\S+) serves", victim.log_path.read_text())[-1]
    kill(victim.process)
    streams.join()
    assert streams.errors == []
    assert streams.tokens == expected
    # streams were running on the killed pod, and the gateway moved them
    gateway_log = cluster.child("gateway").log_tail(100_000)
    assert f"decode pod {victim_address} failed after" in gateway_log, \
        [line for line in gateway_log.splitlines() if "WARNING" in line or "ERROR" in line][-20:]
    serves_a_new_request(cluster.gateway_address)

    # 2. A chain rank dies while long prompts are in the chain: they are prefilled on a
    #    decode pod instead. (Prompts no pod has cached: step 1's went to the pods' caches.)
    long_prompts, long_expected = unseen_long_prompts
    streams = Streams(cluster.gateway_address, long_prompts, first_index=16)
    streams.wait_for_tokens(1, streams=1)  # the chain is working through the other 15
    kill(cluster.child("prefill-1").process)
    streams.join()
    assert streams.errors == []
    assert streams.tokens == long_expected
    assert "chain chain-0 failed it" in cluster.child("gateway").log_tail(100_000)
    serves_a_new_request(cluster.gateway_address)

    # 3. Redis dies mid-stream: the gateway routes from its last view, the streams go on.
    streams = Streams(cluster.gateway_address, everything[:16])
    streams.wait_for_tokens(2)
    kill(cluster.redis.process)
    streams.join()
    assert streams.errors == []
    assert streams.tokens == expected[:16]
    serves_a_new_request(cluster.gateway_address)

    deadline = time.monotonic() + 10  # the supervisor restarts each as it sees it exit
    while not all(any(what in line for line in restarts) for what in ("decode-0", "chain", "redis-server")):
        assert time.monotonic() < deadline, f"restarts seen: {restarts}"
        time.sleep(0.1)


def test_a_decode_pod_sent_sigterm_finishes_its_streams_takes_nothing_new_and_exits_0(chaos_cluster,
                                                                                  prompts):
    cluster, _ = chaos_cluster
    everything, expected = prompts
    serves_a_new_request(cluster.gateway_address)
    streams = Streams(cluster.gateway_address, everything[4:16], first_index=4)
    streams.wait_for_tokens(2)
    draining = cluster.child("decode-1")
    address = re.findall(r"decode pod (\S+) serves", draining.log_path.read_text())[-1]
    # what the gateway logs from here on (the module's chaos test may have moved a stream off
    # this pod before: a chain's tail killed mid-push to it)
    gateway_log = cluster.child("gateway").log_path
    logged_before = len(gateway_log.read_text())
    draining.process.send_signal(signal.SIGTERM)
    streams.join()
    assert streams.errors == []
    assert streams.tokens == expected[4:16]
    assert draining.process.wait(60) == 0
    # its streams ended there: none had to move
    assert f"decode pod {address} failed" not in gateway_log.read_text()[logged_before:]
    serves_a_new_request(cluster.gateway_address)


def test_streams_on_a_decode_pod_that_stops_answering_move_within_seconds(chaos_cluster, prompts):
    # SIGSTOP: the pod's sockets stay open but nothing answers (a wedged or half-dead pod).
    # The gateway's keepalive pings fail its calls, and the streams move to the other pod.
    cluster, _ = chaos_cluster
    everything, expected = prompts
    serves_a_new_request(cluster.gateway_address)
    streams = Streams(cluster.gateway_address, everything[:16])
    streams.wait_for_tokens(2)
    stopped = cluster.child("decode-0")
    stopped.process.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        streams.join()
        elapsed_s = time.monotonic() - started
    finally:
        stopped.process.send_signal(signal.SIGCONT)
    assert streams.errors == []
    assert streams.tokens == expected[:16]
    assert elapsed_s < 30


CONSTRAINED_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12, "pattern": "^[a-z]*$"},
    "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
               "maxItems": 6},
    "ok": {"type": "boolean"}}, "required": ["name", "values", "ok"], "additionalProperties": False}


def constrained(index: int) -> SamplingParams:
    """Seeded, penalized, a JSON schema and log probabilities: everything a moved stream must
    carry to the next pod (its grammar rebuilt by replay, its penalties from the tokens)."""
    import json

    from baton.sampling.grammar import GrammarSpec

    return SamplingParams(temperature=0.9, seed=500 + index, max_tokens=80, logprobs=2,
                          repetition_penalty=1.2, frequency_penalty=0.3,
                          structured=GrammarSpec("json_schema", json.dumps(CONSTRAINED_SCHEMA)))


def stream_all(address: str, requests: list[GenerateRequest], started: threading.Event | None = None,
               after_tokens: int = 4):
    """Each request streamed on its own thread: (tokens, log probabilities, text) each, or
    the exception it ended in; ``started`` is set once every stream has ``after_tokens``."""
    results: list = [None] * len(requests)
    counts = [0] * len(requests)

    def one(index: int) -> None:
        client = BatonClient(address)
        tokens, logprobs, text = [], [], ""
        try:
            for step in client.stream(requests[index], timeout_s=180):
                tokens += step.token_ids
                logprobs += [entry.logprob for entry in step.logprobs]
                text += step.text
                counts[index] = len(tokens)
                if started is not None and min(counts) >= after_tokens:
                    started.set()
            results[index] = (tokens, logprobs, text)
        except Exception as e:  # noqa: BLE001 - reported by the test
            results[index] = e
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    return threads, results


def kill_the_busiest_pod(cluster, threads) -> None:
    """SIGKILL the decode pod running the most sequences (routing need not spread the streams
    over both), wait for the streams, and check the gateway moved some off it."""
    _, victim_name, address = max(running_on_each_pod(cluster))
    failed = f"decode pod {address} failed after"
    moves_before = cluster.child("gateway").log_tail(1_000_000).count(failed)
    kill(cluster.child(victim_name).process)
    for thread in threads:
        thread.join(200)
    assert cluster.child("gateway").log_tail(1_000_000).count(failed) > moves_before, \
        "no stream was on the killed pod"


def test_a_constrained_stream_moved_by_a_decode_pod_kill_is_the_same_valid_json(chaos_cluster,
                                                                                reference):
    import json

    import jsonschema

    cluster, _ = chaos_cluster
    _, source = reference
    prompts = [source[9000 + i * 41: 9000 + i * 41 + 24] for i in range(8)]
    serves_a_new_request(cluster.gateway_address)
    running_on_each_pod(cluster)  # both pods up (one an earlier test killed may be restarting)
    requests = [GenerateRequest(token_ids=tuple(prompt), sampling=constrained(index),
                                compression=NO_COMPRESSION, prefill_route="local")
                for index, prompt in enumerate(prompts)]
    threads, calm = stream_all(cluster.gateway_address, requests)
    for thread in threads:
        thread.join(200)
    started = threading.Event()
    threads, moved = stream_all(cluster.gateway_address, requests, started)
    assert started.wait(60), "the streams did not start"
    kill_the_busiest_pod(cluster, threads)
    for (tokens, logprobs, text), after in zip(calm, moved):
        assert not isinstance(after, Exception), after
        moved_tokens, moved_logprobs, moved_text = after
        assert moved_tokens == tokens and moved_text == text
        assert moved_logprobs == pytest.approx(logprobs, abs=1e-4)
        assert len(logprobs) == len(tokens)
        jsonschema.validate(json.loads(text), CONSTRAINED_SCHEMA)
    serves_a_new_request(cluster.gateway_address)


def compressed(index: int) -> SamplingParams:
    """Greedy, or seeded for the first two: 100 tokens, long enough for PyramidInfer's
    generation phase to prune several times before and after the kill."""
    if index < 2:
        return SamplingParams(temperature=0.8, seed=700 + index, max_tokens=100)
    return greedy(100)


def test_compressed_streams_moved_by_a_decode_pod_kill_continue_token_for_token(chaos_cluster,
                                                                                reference):
    # PyramidInfer on (the default): prompts of 200 tokens compressed at their prefill, and
    # pruned every 16 generated tokens. A pod killed once every stream has 40 tokens: the
    # moved streams are prefilled on the other pod from their prompt alone, their sent tokens
    # replayed through decode steps, and every stream equals its run without the fault.
    cluster, _ = chaos_cluster
    _, source = reference
    prompts = [source[4000 + i * 67: 4000 + i * 67 + 200] for i in range(6)]
    serves_a_new_request(cluster.gateway_address)
    running_on_each_pod(cluster)  # both pods up (the last test killed one)
    requests = [GenerateRequest(token_ids=tuple(prompt), sampling=compressed(index), prefill_route="local")
                for index, prompt in enumerate(prompts)]  # the deployment's compression: on
    threads, calm = stream_all(cluster.gateway_address, requests)
    for thread in threads:
        thread.join(200)
    assert not any(isinstance(result, Exception) for result in calm), calm
    started = threading.Event()
    threads, moved = stream_all(cluster.gateway_address, requests, started, after_tokens=40)
    assert started.wait(120), f"the streams did not start: {moved}"
    kill_the_busiest_pod(cluster, threads)
    for (tokens, _, _), after in zip(calm, moved, strict=True):
        assert not isinstance(after, Exception), after
        assert len(tokens) == 100 and after[0] == tokens
    serves_a_new_request(cluster.gateway_address)
