"""Reliability: thousands of streams through one gateway, and what each kind of fault costs.

Writes docs/benchmarks/reliability.md from reliability-results.json.gz beside it.

1. Scale: ``LocalCluster`` (one gateway, two decode pods, a 2-rank chain, a private
   redis-server), then 2,000 streaming Generate calls sent at once from one asyncio client
   (grpc.aio, 16 channels), short prompts, 8 greedy tokens each. Reported: how many
   completed, latency P50/P99 (send to last message), the time to the last one, and the
   gateway's resident memory before and at its peak (``VmHWM``).
2. Faults: a fresh cluster, supervised as ``baton up`` supervises it (dead processes
   restarted with backoff). A fault-free run of 48 streams (36 short prompts, 12 through
   the chain, 32 greedy tokens each) gives every request's tokens and the latency baseline;
   then the same 48 again for each fault, injected once every stream has its first tokens
   (the chain rank: 0.3 s after the burst, while the long prompts are in the chain):
   kill -9 of a decode pod, kill -9 of a chain rank, kill -9 of Redis, SIGTERM of a decode
   pod. Reported per fault: requests sent, completed, lost (ended in an error), requests
   whose tokens differ from the fault-free run, tokens repeated, and what the fault added
   to latency P50/P99 and to the time to the last token.

usage: python bench/reliability.py [--streams 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.api import convert
from baton.api.requests import CompressionParams, GenerateRequest
from baton.api.v1 import api_pb2_grpc
from baton.client import BatonClient
from baton.local.child_exits import StopEvent
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.tokenizer import Tokenizer
from baton.routing.redis_store import RedisStore
from baton.sampling.params import SamplingParams
from common import (
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)

CHAIN_THRESHOLD_TOKENS = 128
CHANNELS = 16
FAULT_STREAMS_SHORT, FAULT_STREAMS_LONG, FAULT_TOKENS = 36, 12, 32
SCALE_TOKENS = 8
STREAM_TIMEOUT_S = 600.0


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    error: str = ""
    latency_s: float = 0.0  # send to last message


def prompts_from_source(tokenizer: Tokenizer, count: int, lengths: tuple[int, int], seed: int
                        ) -> list[list[int]]:
    """``count`` slices of the standard library's source, of lengths in ``lengths``."""
    import random

    source = tokenizer.encode(Path(os.__file__).read_text() + Path(json.__file__).read_text())
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length = rng.randint(*lengths)
        start = rng.randrange(0, len(source) - length)
        prompts.append(source[start:start + length])
    return prompts


async def stream_all(address: str, prompts: list[list[int]], max_tokens: int,
                     started: asyncio.Event | None = None) -> tuple[list[Outcome], float]:
    """Send every prompt at once (greedy, no KV compression); returns the outcomes and the
    time to the last message. ``started`` is set once every stream has two tokens."""
    channels = [grpc.aio.insecure_channel(address) for _ in range(CHANNELS)]
    outcomes = [Outcome() for _ in prompts]
    t0 = time.perf_counter()

    async def one(index: int, prompt: list[int]) -> None:
        stub = api_pb2_grpc.BatonStub(channels[index % CHANNELS])
        request = GenerateRequest(token_ids=tuple(prompt), compression=CompressionParams(enabled=False),
                                  sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens))
        outcome = outcomes[index]
        try:
            async for message in stub.Generate(convert.generate_request_to_proto(request),
                                               timeout=STREAM_TIMEOUT_S):
                outcome.tokens += message.token_ids
                if started is not None and not started.is_set() and all(
                        len(o.tokens) >= 2 or o.error for o in outcomes):
                    started.set()
        except grpc.RpcError as e:
            outcome.error = f"{e.code().name}: {e.details()}"
        outcome.latency_s = time.perf_counter() - t0

    try:
        await asyncio.gather(*(one(i, prompt) for i, prompt in enumerate(prompts)))
    finally:
        for channel in channels:
            await channel.close()
    return outcomes, max(outcome.latency_s for outcome in outcomes)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def memory_kib(pid: int, field_name: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field_name}:\s+(\d+) kB", text, re.MULTILINE).group(1))


# --- 1. scale --------------------------------------------------------------------------------


def measure_scale(tokenizer: Tokenizer, num_streams: int) -> dict:
    spec = ClusterSpec(decode_workers=2, chain_ranks=2, prefill_threshold_tokens=CHAIN_THRESHOLD_TOKENS,
                       chain_break_even=False)
    prompts = prompts_from_source(tokenizer, num_streams, (8, 24), seed=1)  # dtype: the default
    with LocalCluster(spec) as cluster:
        BatonClient(cluster.gateway_address).wait_until_serving(60)
        gateway_pid = cluster.child("gateway").process.pid
        rss_before_kib = memory_kib(gateway_pid, "VmRSS")
        outcomes, wall_s = asyncio.run(stream_all(cluster.gateway_address, prompts, SCALE_TOKENS))
        peak_kib = memory_kib(gateway_pid, "VmHWM")
    latencies = [o.latency_s for o in outcomes if not o.error]
    errors = sorted({o.error for o in outcomes if o.error})
    return {"streams": num_streams, "completed": len(latencies),
            "failed": num_streams - len(latencies), "errors": errors[:5],
            "tokens": sum(len(o.tokens) for o in outcomes), "wall_s": wall_s,
            "latency_p50_s": percentile(latencies, 0.5) if latencies else float("nan"),
            "latency_p99_s": percentile(latencies, 0.99) if latencies else float("nan"),
            "gateway_rss_before_mib": rss_before_kib / 1024, "gateway_peak_mib": peak_kib / 1024}


# --- 2. faults -------------------------------------------------------------------------------


class Supervisor:
    """``LocalCluster.supervise`` in a thread, woken by a child's exit, as ``baton up`` runs it."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.events: list[str] = []
        self._stop = StopEvent()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.cluster.wait_for_change(60.0, self._stop)
            self.events += self.cluster.supervise()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def wait_until_whole(cluster: LocalCluster, timeout_s: float = 180.0) -> None:
    """Until Redis lists two decode pods and the chain, and a request completes."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            store = RedisStore(cluster.redis_url)
            try:
                workers = store.list_workers()
            finally:
                store.close()
            whole = (sum(w.role == "decode" for w in workers) >= 2
                     and any(w.role == "prefill" and w.rank == 0 for w in workers))
            if whole:
                BatonClient(cluster.gateway_address).generate(
                    GenerateRequest(text="import os\n", sampling=SamplingParams(temperature=0.0, max_tokens=2)),
                    timeout_s=30)
                return
        except Exception as e:  # noqa: BLE001 - still recovering; reported if it never does
            last_error = e
        time.sleep(0.5)
    raise TimeoutError(f"the cluster did not become whole again (last error: {last_error!r})")


FAULTS = {
    "kill -9 a decode pod": lambda cluster: os.kill(cluster.child("decode-0").process.pid, signal.SIGKILL),
    "kill -9 a chain rank": lambda cluster: os.kill(cluster.child("prefill-1").process.pid, signal.SIGKILL),
    "kill -9 Redis": lambda cluster: os.kill(cluster.redis.process.pid, signal.SIGKILL),
    "SIGTERM a decode pod": lambda cluster: cluster.child("decode-1").process.send_signal(signal.SIGTERM),
}


async def run_with_fault(cluster: LocalCluster, prompts: list[list[int]], fault) -> tuple[list[Outcome], float]:
    started = asyncio.Event()
    task = asyncio.ensure_future(stream_all(cluster.gateway_address, prompts, FAULT_TOKENS, started))
    if fault is not None:
        if fault is FAULTS["kill -9 a chain rank"]:
            await asyncio.sleep(0.3)
        else:
            await asyncio.wait_for(started.wait(), 120)
        fault(cluster)
    return await task


def summarize(name: str, outcomes: list[Outcome], wall_s: float, reference: list[list[int]] | None,
              baseline: dict | None) -> dict:
    completed = [o for o in outcomes if not o.error]
    latencies = [o.latency_s for o in completed]
    row = {"fault": name, "sent": len(outcomes), "completed": len(completed),
           "lost": len(outcomes) - len(completed), "errors": sorted({o.error for o in outcomes if o.error})[:3],
           "wall_s": wall_s, "latency_p50_s": percentile(latencies, 0.5) if latencies else float("nan"),
           "latency_p99_s": percentile(latencies, 0.99) if latencies else float("nan")}
    if reference is not None:
        row["differing"] = sum(o.tokens != ref for o, ref in zip(outcomes, reference) if not o.error)
        row["tokens_repeated"] = sum(max(0, len(o.tokens) - len(ref)) for o, ref in zip(outcomes, reference))
    if baseline is not None:
        for key in ("wall_s", "latency_p50_s", "latency_p99_s"):
            row[f"extra_{key}"] = row[key] - baseline[key]
    return row


def measure_faults(tokenizer: Tokenizer) -> tuple[list[dict], list[str]]:
    prompts = (prompts_from_source(tokenizer, FAULT_STREAMS_SHORT, (10, 60), seed=2)
               + prompts_from_source(tokenizer, FAULT_STREAMS_LONG,
                                     (CHAIN_THRESHOLD_TOKENS, CHAIN_THRESHOLD_TOKENS + 200), seed=3))
    # Every round replays the same prompts (its tokens are compared with the baseline's):
    # with the decode pods' prefix caches on, later rounds would find the long prompts cached
    # and leave the chain idle, and killing a chain rank would test nothing.
    spec = ClusterSpec(decode_workers=2, chain_ranks=2, prefill_threshold_tokens=CHAIN_THRESHOLD_TOKENS,
                       chain_break_even=False, heartbeat_s=0.5, worker_ttl_s=2.0,
                       extra_args={"decode": ["--kv-prefix-cache", "false"]})
    # fp32: a moved stream is recomputed (prompt + tokens sent, prefilled at once), and only
    # in fp32 does that give exactly the tokens of the uninterrupted stream (in bf16 a
    # different batching rounds differently, as a preemption would).
    previous_dtype = os.environ.get("BATON_MODEL_DTYPE")
    os.environ["BATON_MODEL_DTYPE"] = "float32"
    try:
        return _measure_faults(spec, prompts)
    finally:
        if previous_dtype is None:
            os.environ.pop("BATON_MODEL_DTYPE")
        else:
            os.environ["BATON_MODEL_DTYPE"] = previous_dtype


def _measure_faults(spec: ClusterSpec, prompts: list[list[int]]) -> tuple[list[dict], list[str]]:
    rows = []
    with LocalCluster(spec) as cluster:
        supervisor = Supervisor(cluster)
        try:
            wait_until_whole(cluster)
            outcomes, wall_s = asyncio.run(run_with_fault(cluster, prompts, None))
            reference = [o.tokens for o in outcomes]
            baseline = summarize("none (baseline)", outcomes, wall_s, None, None)
            rows.append(baseline | {"differing": 0, "tokens_repeated": 0})
            for name, fault in FAULTS.items():
                wait_until_whole(cluster)
                outcomes, wall_s = asyncio.run(run_with_fault(cluster, prompts, fault))
                rows.append(summarize(name, outcomes, wall_s, reference, baseline))
                print(f"{name}: {rows[-1]['completed']}/{rows[-1]['sent']} completed, "
                      f"{rows[-1]['differing']} differing", flush=True)
        finally:
            supervisor.stop()
    return rows, supervisor.events


# --- report ----------------------------------------------------------------------------------


def report(results: dict) -> str:
    scale, faults, restarts = results["scale"], results["faults"], results["restarts"]
    scale_table = markdown_table(
        ["streams at once", "completed", "failed", "tokens", "time to last token s",
         "latency P50 s", "latency P99 s", "gateway RSS before MiB", "gateway peak RSS MiB"],
        [[scale["streams"], scale["completed"], scale["failed"], scale["tokens"],
          f"{scale['wall_s']:.1f}", f"{scale['latency_p50_s']:.2f}", f"{scale['latency_p99_s']:.2f}",
          f"{scale['gateway_rss_before_mib']:.0f}", f"{scale['gateway_peak_mib']:.0f}"]])
    fault_rows = []
    for row in faults:
        extra = (f"{row['extra_latency_p50_s']:+.2f} / {row['extra_latency_p99_s']:+.2f} / "
                 f"{row['extra_wall_s']:+.2f}" if "extra_wall_s" in row else "")
        fault_rows.append([row["fault"], row["sent"], row["completed"], row["lost"], row["differing"],
                           row["tokens_repeated"],
                           f"{row['latency_p50_s']:.2f} / {row['latency_p99_s']:.2f} / {row['wall_s']:.2f}",
                           extra, "; ".join(row["errors"]) or "none"])
    fault_table = markdown_table(
        ["fault", "sent", "completed", "lost", "tokens differ from fault-free", "tokens repeated",
         "latency P50 / P99 / last token s", "added by the fault s", "errors"], fault_rows)
    failed = "" if not scale["errors"] else f"\nErrors seen: {'; '.join(scale['errors'])}.\n"
    header = report_header("Reliability: many streams, and faults mid-stream",
                           "bench/reliability.py", "reliability", results)
    return f"""{header}
Load average {results['load_average_end']:.1f} at the end. The method is in the script's
docstring. Every process is a real one on loopback: gateway, two decode pods, a 2-rank KV-Runahead chain and
a private redis-server (`LocalCluster`, the same as `baton up`), one torch thread each.

## 2,000 streams through one gateway

All sent at once by one asyncio client over 16 channels: prompts of 8-24 tokens from the
standard library's source, {SCALE_TOKENS} greedy tokens each. The gateway and the decode pods
serve them on `grpc.aio` event loops: no thread per stream.

{scale_table}
{failed}
## Faults mid-stream

48 concurrent streams (36 short prompts, 12 through the chain), {FAULT_TOKENS} greedy tokens
each, KV compression off, fp32 (a moved stream is recomputed; only in fp32 is that exact
token for token, as for any recompute); the fault-free run gives every request's tokens
and the baseline latency. Each fault is injected once every stream has its first tokens (the chain rank:
0.3 s after the burst, while the long prompts are being prefilled), and the processes are
supervised as `baton up` supervises them. "Lost" is a stream that ended in an error; "tokens
differ" counts completed streams whose tokens are not the fault-free run's.

{fault_table}

Restarts by the supervisor during the run:

{chr(10).join(f"* {event}" for event in restarts) or "* none"}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--render", action="store_true",
                        help="render the report again from the committed raw results")
    args = parser.parse_args()
    if args.render:
        write_report("reliability.md", report(load_results("reliability")))
        return
    record = run_record()  # with the load average as the run begins
    tokenizer = Tokenizer.from_dir(SHIPPED_MODEL_DIR)
    scale = measure_scale(tokenizer, args.streams)
    print(f"scale: {scale['completed']}/{scale['streams']} in {scale['wall_s']:.1f} s", flush=True)
    faults, restarts = measure_faults(tokenizer)
    save_results("reliability", {"run": record, "scale": scale, "faults": faults,
                                 "restarts": restarts,
                                 "load_average_end": round(os.getloadavg()[0], 1)})
    write_report("reliability.md", report(load_results("reliability")))


if __name__ == "__main__":
    main()
