"""What tracing costs a request: end-to-end latency through the OpenAI door with
``--otlp-traces-endpoint`` set and without.

Two local clusters side by side (real processes; each a gateway and one decode pod, no
chain, so every request makes the gateway's and the decode pod's spans), one exporting to an
OTLP receiver in this process, the other untraced. Each round sends the same short prompts
one after another to both, which goes first alternating round by round, so a machine's
drift falls on both alike. Latency: the client's, request sent to answer read (greedy, a
fixed number of tokens). Writes docs/benchmarks/trace-overhead.md from
trace-overhead-results.json.gz.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]
from baton.config import OtlpConfig
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from baton.serving import free_port
from common import (
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)
from otlp_receiver import OtlpReceiver

NAME = "trace-overhead"
SETTINGS = ("off", "on")
PROMPT = "def fibonacci(n):\n"


def complete(base_url: str, max_tokens: int) -> float:
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base_url}/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - started


def measure(args: argparse.Namespace) -> dict:
    receiver = OtlpReceiver()
    record = run_record()
    latencies: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    started = time.monotonic()
    specs = {setting: ClusterSpec(decode_workers=1, chain_ranks=0, gateway_http_port=free_port(),
                                  decode_threads=args.threads,
                                  otlp=OtlpConfig(receiver.endpoint if setting == "on" else ""))
             for setting in SETTINGS}
    try:
        with LocalCluster(specs["off"]) as off, LocalCluster(specs["on"]) as on:
            clusters = {"off": off, "on": on}
            for cluster in clusters.values():  # warm: kernels, first allocations
                for _ in range(3):
                    complete(cluster.gateway_http_url, args.max_tokens)
            for round_index in range(args.rounds):
                order = SETTINGS if round_index % 2 == 0 else SETTINGS[::-1]
                for setting in order:
                    for _ in range(args.requests):
                        latencies[setting].append(complete(clusters[setting].gateway_http_url,
                                                           args.max_tokens))
    finally:
        receiver.stop()
    return {"run": record, "rounds": args.rounds, "requests": args.requests,
            "max_tokens": args.max_tokens, "threads": args.threads,
            "seconds": time.monotonic() - started, "latency_s": latencies,
            "spans_received": len(receiver.spans)}


def report(results: dict) -> str:
    off = statistics.median(results["latency_s"]["off"])
    rows = []
    for setting in SETTINGS:
        times = sorted(results["latency_s"][setting])
        median = statistics.median(times)
        p90 = times[int(0.9 * (len(times) - 1))]
        rows.append([setting, len(times), f"{median * 1000:.1f}", f"{p90 * 1000:.1f}",
                     f"{median / off:.3f}"])
    return "\n".join([
        report_header("Tracing: what a request pays", "bench/trace_overhead.py", NAME, results),
        (f"{results['rounds']} interleaved rounds of {results['requests']} requests per setting "
         f"({results['max_tokens']} tokens each, greedy, one at a time) through the OpenAI door "
         f"of two local clusters (a gateway and one decode pod of {results['threads']} thread(s) "
         f"each), one exporting its spans over OTLP/gRPC to a receiver in the benchmark's "
         f"process ({results['spans_received']} spans received), {results['seconds']:.0f} s in all."),
        "",
        markdown_table(["tracing", "requests", "median latency (ms)", "p90 latency (ms)",
                        "median / off"], rows),
        "",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=10, help="requests per setting a round")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each decode pod")
    parser.add_argument("--render", action="store_true", help="only render the committed results")
    args = parser.parse_args()
    if not args.render:
        save_results(NAME, measure(args))
    write_report(f"{NAME}.md", report(load_results(NAME)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
