"""The local cluster the end-to-end tests share, and the references it must match."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
from baton.api.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from baton.config import KVPoolConfig
from baton.local.child_exits import StopEvent
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.loader import load_checkpoint
from baton.routing import WorkerLoad
from baton.sampling.params import SamplingParams
from baton.sarathi.engine import Engine

CHAIN_THRESHOLD_TOKENS = 128  # prompts this long go through the chain
WORKER_TTL_S = 2.0


def skip_without_cluster_parts() -> None:
    """Skip the calling test when this machine cannot run the local cluster."""
    from redis_server import redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed; `make setup` installs it")
    if not (SHIPPED_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("the shipped model is missing")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


class MonolithicReference:
    """The shipped model in this process, generating greedily with baton's engine (no chain,
    no compression): what every path through the cluster must reproduce."""

    def __init__(self) -> None:
        loaded = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cpu")
        self.tokenizer = loaded.tokenizer
        self.engine = Engine(loaded.model, loaded.tokenizer, kv=KVPoolConfig(num_blocks=512))

    def tokens(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        return self.engine.generate([prompt_ids], greedy(max_tokens))[0].token_ids


def long_prompt_ids(tokenizer, num_tokens: int) -> list[int]:
    """Real Python source of at least ``num_tokens`` tokens, cut to exactly that many."""
    import inspect
    import json

    ids = tokenizer.encode(inspect.getsource(json.decoder))
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def worker_load(cluster, address: str, role: str) -> WorkerLoad:
    """A pod's load, asked over its internal port with the cluster's gateway certificate."""
    from baton.security.mtls import Mtls

    with Mtls(cluster.mtls_for("gateway")).channel(address, []) as channel:
        stub = (decode_pb2_grpc.DecodeStub(channel) if role == "decode"
                else prefill_pb2_grpc.PrefillStub(channel))
        message = stub.Stats(common_pb2.StatsRequest(), timeout=5)
    return WorkerLoad(free_kv_blocks=message.free_kv_blocks,
                      total_kv_blocks=message.total_kv_blocks,
                      running_sequences=message.running_sequences,
                      queued_requests=message.queued_requests,
                      queued_prompt_tokens=message.queued_prompt_tokens)


def decode_addresses(cluster) -> list[str]:
    from baton.routing.redis_store import RedisStore

    store = RedisStore(cluster.redis_url)
    try:
        return [worker.address for worker in store.list_workers("decode")]
    finally:
        store.close()


def all_kv_free(cluster) -> bool:
    """Every decode pod of ``cluster`` holds no sequence and no KV."""
    loads = [worker_load(cluster, address, "decode") for address in decode_addresses(cluster)]
    return all(load.free_kv_blocks == load.total_kv_blocks and load.running_sequences == 0
               for load in loads)


def wait_until(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


@contextlib.contextmanager
def supervised(cluster) -> Iterator[list[str]]:
    """``cluster.supervise()`` in a thread while the block runs, woken by a child's exit as
    `baton up` runs it (a dead process is restarted); yields the restarts it reported."""
    stop = StopEvent()
    restarts: list[str] = []

    def supervise() -> None:
        while not stop.is_set():
            cluster.wait_for_change(60.0, stop)
            restarts.extend(cluster.supervise())

    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    try:
        yield restarts
    finally:
        stop.set()
        supervisor.join(10)
