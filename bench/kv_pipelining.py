"""Does shipping each layer as the chain computes it hide the KV's transfer on `baton up`?

One question: a chain's tail can ship a prompt's KV layer by layer while it computes the
next layer (`--chain-kv-shipping by-layer`, the default), or whole once the logits exist
(`after-prefill`). The first token goes ahead of the KV either way (on the header after the
prefill; in its own message before the last layer by layer), so the difference shows in the
second token: the decode pod can take the request only once the last layer has landed.

Each round starts a fresh local cluster (`LocalCluster`: gateway, a 2-rank chain, one decode
pod, KV compression off) per shipping mode, on `random-50m` (8 layers, 4 KV heads of 64,
fp32: 16 KiB of KV per token, a context of 16k; random weights, the shipped tokenizer), and
sends prompts of 1k-4k tokens one at a time through the gateway's gRPC door, pinned to the
chain, each prompt new, 4 new tokens each, greedy. Modes alternate round by round (A B B A).

    .venv/bin/python bench/kv_pipelining.py --rounds 4
    .venv/bin/python bench/kv_pipelining.py --report-only

Writes docs/benchmarks/kv-pipelining.md from docs/benchmarks/kv-pipelining-results.json.gz.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPORT_DIR, git, machine_description, markdown_table, write_report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPORT_DIR / "kv-pipelining-results.json.gz"
LENGTHS = (1024, 2048, 4096)
MODES = ("after-prefill", "by-layer")
PRESET = "random-50m"


def make_model(directory: Path) -> Path:
    """``PRESET`` with its random weights, saved with the shipped tokenizer."""
    import torch
    from baton.model.loader import SHIPPED_MODEL_DIR, save_checkpoint
    from baton.model.presets import random_model

    save_checkpoint(random_model(PRESET), directory, dtype=torch.float32)
    shutil.copy(SHIPPED_MODEL_DIR / "tokenizer.json", directory / "tokenizer.json")
    return directory


def measure(mode: str, model_dir: Path, requests_per_length: int, first_prompt: int) -> dict:
    """One round of one mode on a fresh cluster: per length, each request's client times."""
    from baton.api.requests import CompressionParams, GenerateRequest
    from baton.client import BatonClient
    from baton.local.cluster import ClusterSpec, LocalCluster
    from baton.model.loader import SHIPPED_MODEL_DIR, load_checkpoint
    from baton.model.sampling import SamplingParams

    tokenizer = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cpu").tokenizer
    source = tokenizer.encode(Path(os.__file__).read_text() * 4)
    spec = ClusterSpec(model_path=str(model_dir), decode_workers=1, chain_ranks=2,
                       prefill_threshold_tokens=128, chain_break_even=False,
                       extra_args={"prefill": ["--chain-kv-shipping", mode]})
    cells: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as logs, LocalCluster(spec, log_dir=Path(logs)) as cluster:
        client = BatonClient(cluster.gateway_address)
        client.wait_until_serving(timeout_s=120)
        warm = GenerateRequest(token_ids=tuple(source[:256]), prefill_route="chain",
                               sampling=SamplingParams(temperature=0.0, max_tokens=2))
        client.generate(warm)
        index = first_prompt
        for _ in range(requests_per_length):
            for length in LENGTHS:
                start = 97 * index % (len(source) - length)
                index += 1
                request = GenerateRequest(token_ids=tuple(source[start:start + length]),
                                          prefill_route="chain",
                                          sampling=SamplingParams(temperature=0.0, max_tokens=4,
                                                                  ignore_eos=True),
                                          compression=CompressionParams(enabled=False))
                sent = time.perf_counter()
                arrivals, last = [], None
                for step in client.stream(request, timeout_s=600):
                    arrivals += [time.perf_counter() - sent] * len(step.token_ids)
                    last = step
                cells.setdefault(str(length), []).append({
                    "ttft_s": arrivals[0], "second_s": arrivals[1],
                    "prefill_s": last.timings.prefill_s,
                    "kv_bytes": last.usage.kv_bytes_shipped})
        client.close()
    return cells


def run_round(mode: str, model_dir: Path, requests_per_length: int, first_prompt: int) -> dict:
    """One round in a fresh process (each cluster's clients start clean)."""
    output = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", mode,
                             "--model", str(model_dir), "--requests", str(requests_per_length),
                             "--first-prompt", str(first_prompt)],
                            cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(output.stdout.strip().splitlines()[-1])



def run(rounds: int, requests_per_length: int) -> dict:
    results = {"commit": git("rev-parse", "HEAD"), "clean": not git("status", "--porcelain", "-uno"),
               "machine": machine_description(),
               "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": []}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = make_model(Path(scratch) / PRESET)
        for number in range(rounds):
            order = MODES if number % 2 == 0 else tuple(reversed(MODES))
            for mode in order:  # both modes get the same new prompts in a round
                cells = run_round(mode, model_dir, requests_per_length, number * 1000)
                results["rounds"].append({"round": number + 1, "mode": mode, "cells": cells})
                print(f"round {number + 1} {mode}: done", flush=True)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results["load_average_end"] = round(os.getloadavg()[0], 1)
    return results


def report(results: dict) -> str:
    pooled = {mode: {str(length): [] for length in LENGTHS} for mode in MODES}
    for entry in results["rounds"]:
        for length, requests in entry["cells"].items():
            pooled[entry["mode"]][length] += requests
    rows = []
    for length in map(str, LENGTHS):
        after, by_layer = pooled["after-prefill"][length], pooled["by-layer"][length]
        if not after or not by_layer:
            continue

        def p50(requests, key):
            return statistics.median(request[key] for request in requests) * 1000

        def gap(requests):  # the second token's wait after the first: the KV's, then a step
            return statistics.median(r["second_s"] - r["ttft_s"] for r in requests) * 1000

        mib = statistics.median(r["kv_bytes"] for r in after) / 2**20
        rows.append([length, f"{mib:.0f}", len(after), f"{p50(after, 'prefill_s'):.0f}",
                     f"{p50(after, 'ttft_s'):.0f}", f"{p50(by_layer, 'ttft_s'):.0f}",
                     f"{p50(after, 'second_s'):.0f}", f"{p50(by_layer, 'second_s'):.0f}",
                     f"{gap(after):.0f}", f"{gap(by_layer):.0f}",
                     f"**{p50(by_layer, 'second_s') / p50(after, 'second_s'):.2f}x**"])
    return "\n".join([
        "# Layer-by-layer KV shipping: the chain's second token, by layer against after prefill",
        "",
        (f"Written by `bench/kv_pipelining.py` from "
         f"[kv-pipelining-results.json.gz](kv-pipelining-results.json.gz): commit "
         f"`{results['commit'][:12]}`{'' if results['clean'] else ' (with uncommitted changes)'}, "
         f"started {results['started']}, finished {results['finished']}."),
        "",
        (f"Machine: {results['machine']}; load average {results['load_average_end']} at the end. "
         "Nothing else ran."),
        "",
        (f"Each round starts a fresh `LocalCluster` per mode (gateway, a 2-rank chain, one decode "
         f"pod; KV compression off) on `{PRESET}` (random weights, fp32: 16 KiB of KV per token), "
         "then sends prompts one at a time pinned to the chain, every prompt new, 4 new tokens "
         "each, greedy; times are the client's, from sending the request. The first token leaves "
         "ahead of the KV in both modes; the second needs the whole cache on the decode pod. "
         "Modes alternate round by round."),
        "",
        markdown_table(["prompt tokens", "KV MiB", "requests per mode", "chain prefill P50 ms",
                        "TTFT after-prefill", "TTFT by-layer", "2nd token after-prefill",
                        "2nd token by-layer", "2nd - 1st after-prefill", "2nd - 1st by-layer",
                        "2nd token by-layer / after-prefill"], rows),
        "",
        "All times are P50 in ms.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=3, help="requests per length a round")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--measure", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--first-prompt", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, Path(args.model), args.requests, args.first_prompt)))
        return
    if not args.report_only:
        results = run(args.rounds, args.requests)
        with gzip.open(RESULTS, "wt") as file:
            json.dump(results, file)
    with gzip.open(RESULTS, "rt") as file:
        write_report("kv-pipelining.md", report(json.load(file)))


if __name__ == "__main__":
    main()
