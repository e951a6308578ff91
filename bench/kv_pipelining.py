"""Does shipping each layer as the chain computes it hide the KV's transfer on `baton up`?

One question: a chain's tail can ship a prompt's KV layer by layer while it computes the
next layer (`--chain-kv-shipping by-layer`, the default), or whole once the logits exist
(`after-prefill`). The first token goes ahead of the KV either way (on the header after the
prefill; in its own message before the last layer by layer), so the difference shows in the
second token: the decode pod can take the request only once the last layer has landed. A
third mode ships by layer over NIXL (`--kv-transport-kind nixl` on the chain and the decode
pod, when the package is installed): each layer's bytes read by the pod, not streamed.

Each round starts a fresh local cluster (`LocalCluster`: gateway, a 2-rank chain, one decode
pod, KV compression off) per shipping mode, on `random-50m` (8 layers, 4 KV heads of 64, a
context of 16k; random weights saved in fp32, the shipped tokenizer; the pods run it in the
precision `auto` picks, so the report gives the KV bytes per token they shipped), and
sends prompts of 1k-8k tokens one at a time through the gateway's gRPC door, pinned to the
chain, each prompt new, 4 new tokens each, greedy. Modes alternate round by round (A B C,
C B A). Every push's bytes are counted by the decode pod per data plane (its /metrics).

    .venv/bin/python bench/kv_pipelining.py --rounds 4
    .venv/bin/python bench/kv_pipelining.py --render

Writes docs/benchmarks/kv-pipelining.md from docs/benchmarks/kv-pipelining-results.json.gz.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (1024, 2048, 4096, 8192)
BY_LAYER_NIXL = "by-layer, NIXL"
# Each mode's flags for the chain's ranks and the decode pod.
MODES = {"after-prefill": ["--chain-kv-shipping", "after-prefill"],
         "by-layer": ["--chain-kv-shipping", "by-layer"],
         BY_LAYER_NIXL: ["--chain-kv-shipping", "by-layer", "--kv-transport-kind", "nixl"]}
PRESET = "random-50m"


def modes() -> tuple[str, ...]:
    """The modes this machine can run (NIXL's only where the package is installed)."""
    from baton.transfer.nixl import nixl_missing

    return tuple(mode for mode in MODES if mode != BY_LAYER_NIXL or nixl_missing() is None)


def make_model(directory: Path) -> Path:
    """``PRESET`` with its random weights, saved with the shipped tokenizer."""
    import torch
    from baton.model.hub import SHIPPED_MODEL_DIR
    from baton.model.loader import save_checkpoint
    from baton.model.presets import random_model

    save_checkpoint(random_model(PRESET), directory, dtype=torch.float32)
    shutil.copy(SHIPPED_MODEL_DIR / "tokenizer.json", directory / "tokenizer.json")
    return directory


def measure(mode: str, model_dir: Path, requests_per_length: int, first_prompt: int) -> dict:
    """One round of one mode on a fresh cluster: per length, each request's client times."""
    from baton.api.requests import CompressionParams, GenerateRequest
    from baton.client import BatonClient
    from baton.local.cluster import LocalCluster
    from baton.local.spec import ClusterSpec
    from baton.model.hub import SHIPPED_MODEL_DIR
    from baton.model.loader import load_checkpoint
    from baton.sampling.params import SamplingParams

    tokenizer = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cpu").tokenizer
    source = tokenizer.encode(Path(os.__file__).read_text() * 4)
    from baton.planner import parse_pod
    from baton.serving import free_port

    transport = ["--kv-transport-kind", "nixl"] if mode == BY_LAYER_NIXL else []
    metrics_port = free_port()
    spec = ClusterSpec(model_path=str(model_dir), decode_workers=1, chain_ranks=2,
                       prefill_threshold_tokens=128, chain_break_even=False,
                       extra_args={"prefill": MODES[mode],
                                   "decode": [*transport, "--server-metrics-port", str(metrics_port)]})
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
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
            pod = parse_pod("decode", "decode", page.read().decode())
    shipped = sum(r["kv_bytes"] for requests in cells.values() for r in requests)
    by_plane = {plane: pod.value("baton_decode_kv_bytes_received_total", transport=plane)
                for plane in ("grpc", "nixl")}
    plane = "nixl" if mode == BY_LAYER_NIXL else "grpc"
    # the warm-up's bytes came too; every measured byte came over the mode's plane
    assert by_plane[plane] >= shipped and sum(by_plane.values()) == by_plane[plane], by_plane
    return {"cells": cells, "bytes_by_plane": by_plane}


def run_round(mode: str, model_dir: Path, requests_per_length: int, first_prompt: int) -> dict:
    """One round in a fresh process (each cluster's clients start clean)."""
    output = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", mode,
                             "--model", str(model_dir), "--requests", str(requests_per_length),
                             "--first-prompt", str(first_prompt)],
                            cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(output.stdout.strip().splitlines()[-1])



def run(rounds: int, requests_per_length: int) -> dict:
    results = {"run": run_record(), "rounds": []}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = make_model(Path(scratch) / PRESET)
        for number in range(rounds):
            order = modes() if number % 2 == 0 else tuple(reversed(modes()))
            for mode in order:  # every mode gets the same new prompts in a round
                measured = run_round(mode, model_dir, requests_per_length, number * 1000)
                results["rounds"].append({"round": number + 1, "mode": mode, **measured})
                print(f"round {number + 1} {mode}: {measured['bytes_by_plane']}", flush=True)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results["load_average_end"] = round(os.getloadavg()[0], 1)
    return results


def report(results: dict) -> str:
    present = [mode for mode in MODES if any(e["mode"] == mode for e in results["rounds"])]
    pooled = {mode: {str(length): [] for length in LENGTHS} for mode in present}
    for entry in results["rounds"]:
        for length, requests in entry["cells"].items():
            pooled[entry["mode"]][length] += requests

    def p50(requests, key):
        return statistics.median(request[key] for request in requests) * 1000

    def gap(requests):  # the second token's wait after the first: the KV's, then a step
        return statistics.median(r["second_s"] - r["ttft_s"] for r in requests) * 1000

    times, gaps, per_token = [], [], set()
    for length in map(str, LENGTHS):
        cells = [pooled[mode][length] for mode in present]
        if not all(cells):
            continue
        after = pooled["after-prefill"][length]
        mib = statistics.median(r["kv_bytes"] for r in after) / 2**20
        per_token.add(round(mib * 1024 / int(length)))  # KiB; positions ride along
        times.append([length, f"{mib:.0f}", len(after), f"{p50(after, 'prefill_s'):.0f}",
                      *[f"{p50(cell, 'ttft_s'):.0f}" for cell in cells],
                      *[f"{p50(cell, 'second_s'):.0f}" for cell in cells]])
        gaps.append([length, *[f"{gap(cell):.0f}" for cell in cells],
                     *[f"**{p50(cell, 'second_s') / p50(after, 'second_s'):.2f}x**"
                       for cell in cells[1:]]])
    planes = [f"{e['mode']}: " + ", ".join(f"{plane} {num / 2**20:.0f} MiB"
                                          for plane, num in e["bytes_by_plane"].items() if num)
              for e in results["rounds"] if "bytes_by_plane" in e and e["round"] == 1]
    return "\n".join([
        report_header("Layer-by-layer KV shipping: the chain's second token, by layer against "
                      "after prefill", "bench/kv_pipelining.py", "kv-pipelining", results,
                      f"python bench/kv_pipelining.py --rounds {max(e['round'] for e in results['rounds'])}"),
        f"Finished {results['finished']}; load average {results['load_average_end']} at the end.",
        "",
        (f"Each round starts a fresh `LocalCluster` per mode (gateway, a 2-rank chain, one decode "
         f"pod; KV compression off) on `{PRESET}` (random weights; the pods ship "
         f"{' or '.join(map(str, sorted(per_token)))} KiB of KV per token in the precision "
         "`auto` picks here), "
         "then sends prompts one at a time pinned to the chain, every prompt new, 4 new tokens "
         "each, greedy; times are the client's, from sending the request. The first token leaves "
         "ahead of the KV in every mode; the second needs the whole cache on the decode pod. "
         f"Modes: {', '.join(present)}; their order is reversed every other round, "
         f"{len(results['rounds']) // len(present)} rounds."),
        "",
        *([("The decode pod counted every pushed byte by the plane that carried it (round 1, "
            "the warm-up included): " + "; ".join(planes) + ".") , ""] if planes else []),
        markdown_table(["prompt tokens", "KV MiB", "requests per mode", "chain prefill P50 ms",
                        *[f"TTFT {mode}" for mode in present],
                        *[f"2nd token {mode}" for mode in present]], times),
        "",
        markdown_table(["prompt tokens", *[f"2nd - 1st {mode}" for mode in present],
                        *[f"2nd token {mode} / after-prefill" for mode in present[1:]]], gaps),
        "",
        "All times are P50 in ms.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2, help="requests per length a round")
    parser.add_argument("--render", "--report-only", dest="render", action="store_true",
                        help="render the report again from the committed raw results")
    parser.add_argument("--measure", choices=tuple(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--first-prompt", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, Path(args.model), args.requests, args.first_prompt)))
        return
    if not args.render:
        save_results("kv-pipelining", run(args.rounds, args.requests))
    write_report("kv-pipelining.md", report(load_results("kv-pipelining")))


if __name__ == "__main__":
    main()
