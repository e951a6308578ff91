"""`baton up --autoscale` on real processes: the planner, reading the pods' real /metrics,
retires a decode pod while greedy streams run, the streams it ran move to the other pod,
and no client loses or gets twice a token (each stream equals the monolithic engine's);
the HTTP API's /metrics shows the planner's target and the live count. The planner's clock
is the test's: its interval and cool-downs pass when the test says so."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from baton.config import PlannerConfig
from baton.local.autoscaler import LocalAutoscaler
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from baton.planner import parse_pod
from baton.serving import free_port
from e2e_cluster import (
    WORKER_TTL_S,
    MonolithicReference,
    greedy,
    skip_without_cluster_parts,
)

pytestmark = pytest.mark.slow
MAX_TOKENS = 64
NUM_STREAMS = 4
GRACE_S = 0.5  # shorter than the streams: the retired pod's streams are moved, not finished
# Targets no load here misses: the only reason to size is the load itself (none finished
# yet, so only the KV in use counts: one pod holds it).
PLANNER = PlannerConfig(ttft_p90_s=60.0, itl_p90_s=10.0, min_decode_pods=1, max_decode_pods=2,
                        interval_s=1.0, window_s=60.0, scale_up_cooldown_s=0.0,
                        scale_down_cooldown_s=0.0)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory):
    skip_without_cluster_parts()
    spec = ClusterSpec(decode_workers=2, chain_ranks=0, gateway_http_port=free_port(),
                       heartbeat_s=0.5, worker_ttl_s=WORKER_TTL_S, autoscale=PLANNER,
                       decode_grace_s=GRACE_S)
    with LocalCluster(spec, log_dir=tmp_path_factory.mktemp("autoscale-logs")) as cluster:
        yield cluster


class Streams:
    """Greedy completions through the OpenAI API, each on its own thread, KV uncompressed."""

    def __init__(self, base_url: str, prompts: list[list[int]]) -> None:
        self.api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._one, args=(i, prompt), daemon=True)
                         for i, prompt in enumerate(prompts)]
        for thread in self._threads:
            thread.start()

    def _one(self, index: int, prompt: list[int]) -> None:
        try:
            model = self.api.models.list().data[0].id
            for chunk in self.api.completions.create(
                    model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                    extra_body={"return_token_ids": True, "compression": {"enabled": False}}):
                for choice in chunk.choices:
                    self.tokens[index] += choice.model_extra.get("token_ids") or []
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.errors.append(f"request {index}: {e!r}")

    def wait_for_tokens(self, at_least: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while min(len(tokens) for tokens in self.tokens) < at_least and not self.errors:
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.02)

    def join(self, timeout_s: float = 150) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(thread.is_alive() for thread in self._threads), "a stream did not end"


def door_metrics(cluster: LocalCluster):
    """The gateway's HTTP /metrics, parsed."""
    url = cluster.gateway_http_url.removesuffix("/v1") + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse_pod("gateway", "gateway", response.read().decode())


def test_a_decode_pod_retired_mid_stream_loses_and_repeats_no_token(autoscaled):
    cluster, clock = autoscaled, Clock()
    reference = MonolithicReference()
    source = reference.tokenizer.encode(Path(os.__file__).read_text())
    prompts = [source[i * 41: i * 41 + 24 + 3 * i] for i in range(NUM_STREAMS)]
    expected = [result.token_ids for result in reference.engine.generate(
        prompts, [greedy(MAX_TOKENS)] * NUM_STREAMS)]
    autoscaler = LocalAutoscaler(cluster, clock=clock)
    assert autoscaler.tick() == []  # the first scrape: nothing to compare it with yet

    streams = Streams(cluster.gateway_http_url, prompts)
    streams.wait_for_tokens(at_least=4)
    assert autoscaler.tick() == [], "the interval has not passed on the planner's clock"
    clock.now_s += PLANNER.interval_s
    events = autoscaler.tick()

    retired = autoscaler.last_decision.drain_decode_pod
    assert len(events) == 1 and f"decode pods 2 -> 1 (draining {retired})" in events[0], events
    assert [child.name for child, _ in cluster.retiring] == [retired]
    assert retired not in [child.name for child in cluster.decode_pods()]
    door = door_metrics(cluster)
    assert door.value("baton_planner_target_replicas", role="decode") == 1
    assert door.value("baton_replicas", role="decode") == 1
    assert door.value("baton_gateway_requests_in_flight") == NUM_STREAMS  # still streaming

    streams.join()
    assert not streams.errors, streams.errors
    for index, (got, want) in enumerate(zip(streams.tokens, expected)):
        assert got == want, f"stream {index}: {len(got)} tokens, {len(want)} expected"
    child = next(child for child, _ in cluster.retiring)
    child.process.wait(timeout=30)
    # The streams the retired pod still ran when its grace ended moved (the pod drained has
    # the fewest; the routing policy may have put none there, or they may have ended within
    # the grace: then nothing moved).
    cut = sum(int(n) for n in re.findall(r"draining: (\d+) open requests cut",
                                         child.log_path.read_text()))
    migrations = door_metrics(cluster).value("baton_gateway_migrations_total")
    assert (migrations >= 1) == (cut >= 1), f"{cut} streams cut at the grace's end, {migrations} moved"
    assert cluster.supervise() == [f"{retired} drained and exited (0)"]
    assert cluster.retiring == [] and len(cluster.decode_pods()) == 1  # not restarted
