"""A 2-rank prefill chain as real `baton prefill` processes (gloo) whose tail pushes to a real
decode server in this process (both registered in a real redis-server): the streamed tokens
equal the monolithic engine, and the chain pushes only to registered decode pods. Every hop
is mTLS with certificates made here; the prefill port refuses callers without a gateway
certificate of the CA. Where NIXL is installed, the chain's tail and the decode pod both
take KV over it, and the chain ships a request over the plane the gateway names for the pod
(exact either way)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest
from baton.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from baton.config import MtlsConfig
from baton.kv.contract import COMPRESSION_OFF, HEADS_COMPLETE
from baton.routing.redis_store import RedisStore
from baton.security.certificates import Authority
from baton.security.mtls import Mtls
from baton.serving import free_port
from baton.transfer.nixl import nixl_missing
from decode.decode_servers import (
    collect,
    make_checkpoint,
    reference_tokens,
    start_decode_server,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis_server import RedisServer, redis_server_binary

pytestmark = pytest.mark.slow

PROMPT = list(range(3, 203, 2))  # 100 tokens: each rank computes a real slice
MAX_TOKENS = 10
START_TIMEOUT_S = 90.0
# Both ends read and push over NIXL where it is installed (and over gRPC too: it is per request).
KV_TRANSPORT = "nixl" if nixl_missing() is None else "grpc"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("chain-model"))


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed; `make setup` installs it")
    server = RedisServer(tmp_path_factory.mktemp("chain-redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def authority():
    return Authority.create("chain test CA")


@pytest.fixture(scope="module")
def pki(authority, tmp_path_factory):
    """Certificates of one CA for every role (the chain and the decode pod speak mTLS)."""
    directory = tmp_path_factory.mktemp("chain-pki")
    return {role: authority.write(directory / role, role) for role in ("decode", "prefill", "gateway")}


def decode_stub(server, pki):
    """A gateway's channel to the decode pod."""
    channel = Mtls(pki["gateway"]).channel(server.address, [])
    return channel, decode_pb2_grpc.DecodeStub(channel)


@pytest.fixture(scope="module")
def decode_server(checkpoint, redis, pki):
    server, _ = start_decode_server(checkpoint, store=RedisStore(redis.url), mtls=pki["decode"],
                                    kv_transport=KV_TRANSPORT)
    yield server
    server.stop(0)


@pytest.fixture(scope="module")
def chain(checkpoint, redis, pki, tmp_path_factory):
    """Rank 0 and rank 1 of chain-test, as `baton prefill` processes; yields rank 0's port.
    Its tail ships each cache whole once the logits exist (the clusters of tests/e2e ship
    layer by layer, the default)."""
    grpc_port, master_port = free_port(), free_port()
    logs = tmp_path_factory.mktemp("chain-logs")
    environment = os.environ | {"OMP_NUM_THREADS": "1"}
    with contextlib.ExitStack() as files:
        processes = []
        for rank in (0, 1):
            command = [sys.executable, "-m", "baton.cli", "prefill", "--model-path", str(checkpoint),
                       "--chain-ranks", "2", "--chain-rank", str(rank),
                       "--chain-chain-id", "chain-test", "--chain-master-port", str(master_port),
                       "--chain-backend", "gloo", "--chain-timeout-s", "30",
                       "--chain-kv-shipping", "after-prefill", "--kv-transport-kind", KV_TRANSPORT,
                       "--pyramid-enabled", "false", "--server-listen", f"127.0.0.1:{grpc_port}",
                       "--server-grace-s", "1", "--mtls-ca", pki["prefill"].ca,
                       "--mtls-cert", pki["prefill"].cert, "--mtls-key", pki["prefill"].key,
                       "--routing-redis-url", redis.url]
            log = files.enter_context(open(logs / f"rank{rank}.log", "w"))
            processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                              env=environment))
        channel = Mtls(pki["gateway"]).channel(f"127.0.0.1:{grpc_port}", [])
        try:
            wait_serving(channel, processes, logs)
            yield Chain(channel, master_port, grpc_port)
        finally:
            channel.close()
            stop_all(processes)


@dataclasses.dataclass
class Chain:
    channel: grpc.Channel  # to rank 0's Prefill service
    master_port: int  # rank 0's rendezvous store
    grpc_port: int  # rank 0's Prefill service


def stop_all(processes) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_serving(channel, processes, logs) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise AssertionError(f"a rank exited: {[p.read_text() for p in logs.iterdir()]}")
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(service="baton.v1.Prefill"),
                                 timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the chain did not start: {[p.read_text() for p in logs.iterdir()]}")


def prefill_request(request_id, decode_address, prompt=PROMPT, kv_transport="", **sampling):
    fields = {"temperature": 0.0, "max_tokens": MAX_TOKENS} | sampling
    return prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                                      sampling=common_pb2.SamplingParams(**fields),
                                      decode_address=decode_address,
                                      decode_kv_transport=kv_transport)


def bytes_received(server) -> dict[str, float]:
    """The decode pod's pushed bytes so far, by the data plane that carried them."""
    counter = server.metrics.kv_bytes_received
    return {transport: counter.labels(transport=transport)._value.get()
            for transport in ("grpc", "nixl")}


@pytest.mark.parametrize("transport", ["grpc", pytest.param("nixl", marks=pytest.mark.skipif(
    KV_TRANSPORT != "nixl", reason=str(nixl_missing())))])
def test_chain_prefill_then_decode_equals_the_monolithic_engine(chain, decode_server, checkpoint,
                                                                pki, transport):
    reference = reference_tokens(checkpoint, PROMPT, MAX_TOKENS)
    stub = prefill_pb2_grpc.PrefillStub(chain.channel)
    decode_channel, decode = decode_stub(decode_server, pki)
    before = bytes_received(decode_server)
    # As the gateway does: the request's stream opens on the decode pod while the chain runs.
    request_id = f"chain-{transport}"
    attach = decode.Attach(decode_pb2.AttachRequest(request_id=request_id, wait_s=60), timeout=120)
    call = stub.Prefill(prefill_request(request_id, decode_server.address, kv_transport=transport),
                        timeout=120)
    started = next(call).started  # the chain took it; the call stays open while it may hold it
    assert started.partition[0] == 0 and started.partition[-1] == len(PROMPT)
    assert len(started.partition) == 3
    tokens, messages = collect(attach)
    call.cancel()
    decode_channel.close()
    # Every token, the chain's first included, came from the decode pod.
    assert tokens == reference
    usage, timings = messages[-1].usage, messages[-1].timings
    assert usage.kv_tokens_kept == usage.kv_tokens_full  # compression off
    assert usage.kv_tokens_full % len(PROMPT) == 0  # every layer holds the whole prompt
    assert usage.kv_bytes_shipped > 0
    assert list(messages[-1].route.partition) == list(started.partition)
    assert timings.prefill_s > 0 and timings.kv_push_s > 0
    # The bytes came over the plane the request named (the pod's record names what it takes).
    after = bytes_received(decode_server)
    assert after[transport] - before[transport] == usage.kv_bytes_shipped
    assert sum(after.values()) - sum(before.values()) == usage.kv_bytes_shipped
    assert decode_server.describe().kv_transport == KV_TRANSPORT


def test_the_chain_and_the_decode_pod_publish_kv_contracts_that_fit(chain, decode_server, redis):
    store = RedisStore(redis.url)
    (head,) = [worker for worker in store.list_workers("prefill") if worker.rank == 0]
    store.close()
    shipped, taken = head.kv_contract, decode_server.describe().kv_contract
    assert shipped is not None and taken is not None
    assert (shipped.layout, shipped.compression) == (HEADS_COMPLETE, COMPRESSION_OFF)
    assert taken.compression != COMPRESSION_OFF, "the pod compresses: it stores a chain's cache as is"
    assert shipped.num_layers == taken.num_layers > 0 and shipped.dtype == taken.dtype
    assert shipped.mismatches(taken) == []


def test_bad_requests_get_their_codes_and_the_chain_keeps_serving(chain, decode_server, checkpoint, pki):
    stub = prefill_pb2_grpc.PrefillStub(chain.channel)
    address = decode_server.address
    cases = [
        (prefill_request("bad-1", address, prompt=[1, 2, 999]), grpc.StatusCode.INVALID_ARGUMENT, "999"),
        (prefill_request("bad-2", address, top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (prefill_request("bad-3", ""), grpc.StatusCode.INVALID_ARGUMENT, "decode"),
        (prefill_request("bad-4", address, max_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT, "1024"),
    ]
    for request, code, named in cases:
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Prefill(request, timeout=60))
        assert error.value.code() == code and named in error.value.details()
    # An address that is no registered decode pod: refused before anything connects to it
    # (a caller cannot make the chain probe or push KV to a host of its choice).
    with socket.create_server(("127.0.0.1", 0)) as bait:
        bait.settimeout(0.5)
        target = f"127.0.0.1:{bait.getsockname()[1]}"
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Prefill(prefill_request("elsewhere", target), timeout=60))
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED and target in error.value.details()
        with pytest.raises(TimeoutError):
            bait.accept()
    with pytest.raises(grpc.RpcError) as error:
        stub.Abort(common_pb2.AbortRequest(request_id="nobody"), timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    # Still serving.
    decode_channel, decode = decode_stub(decode_server, pki)
    call = stub.Prefill(prefill_request("after-bad", address), timeout=120)
    assert next(call).HasField("started")
    tokens, _ = collect(decode.Attach(decode_pb2.AttachRequest(request_id="after-bad", wait_s=60),
                                      timeout=60))
    call.cancel()
    decode_channel.close()
    assert tokens == reference_tokens(checkpoint, PROMPT, MAX_TOKENS)


def listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, local_port = local.rsplit(":", 1)
                if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


def test_the_chains_rendezvous_listens_on_rank_0s_address_only(chain):
    # 127.0.0.1 as /proc/net/tcp writes it (little-endian hex); not 0.0.0.0 or ::
    assert listening_addresses(chain.master_port) == ["0100007F"]


def test_the_prefill_port_takes_only_a_gateway_or_decode_certificate_of_the_ca(chain, pki, authority, tmp_path):
    address = f"127.0.0.1:{chain.grpc_port}"
    stranger = Authority.create("another CA").write(tmp_path / "stranger", "gateway")
    expired = authority.write(tmp_path / "expired", "gateway", expired=True)

    def stats(mtls: MtlsConfig) -> grpc.StatusCode:
        with Mtls(mtls).channel(address, []) as channel:
            stub = prefill_pb2_grpc.PrefillStub(channel)
            try:
                stub.Stats(common_pb2.StatsRequest(), timeout=5)
            except grpc.RpcError as error:
                return error.code()
        return grpc.StatusCode.OK

    assert stats(pki["gateway"]) == grpc.StatusCode.OK
    for refused in (MtlsConfig(insecure=True), stranger, expired):
        assert stats(refused) == grpc.StatusCode.UNAVAILABLE
    # of the CA, but neither a gateway's nor a decode pod's (whose own door sends long
    # prompts to chains): another rank's
    with Mtls(pki["prefill"]).channel(address, []) as channel, pytest.raises(grpc.RpcError) as error:
        list(prefill_pb2_grpc.PrefillStub(channel).Prefill(
            prefill_request("as-prefill", "127.0.0.1:1"), timeout=10))
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
