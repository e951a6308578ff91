"""Time to first token on `baton up`, by route: this tree against a baseline commit.

One question: does a prompt's first token reach the client as fast through the chain (and
on the decode pod) as it did at the baseline? Each round starts a fresh local cluster
(`LocalCluster`: gateway, a 2-rank chain, one decode pod, redis-server, KV compression off,
the chain's break-even off) from one source tree, then sends, one at a time through the
gateway's gRPC door, prompts of 256, 512 and 768 tokens pinned to each route, each prompt
new (no prefix cache hit), 8 new tokens each, greedy; TTFT is the client's, from sending
the request to its first streamed token. Rounds alternate between the trees (A B B A ...).
The route's own cost is each request's TTFT less the prefill compute its final step reports,
which takes the compute's spread between clusters out of the comparison.

    .venv/bin/python bench/route_ttft.py --baseline 956553d~1 --rounds 4
    .venv/bin/python bench/route_ttft.py --render

Writes docs/benchmarks/route-ttft.md from docs/benchmarks/route-ttft-results.json.gz.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    git,
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (256, 512, 768)
ROUTES = ("chain", "local")


def measure(requests_per_cell: int, first_prompt: int) -> dict:
    """One round on a cluster of the tree this process imports baton from."""
    from baton.api.requests import CompressionParams, GenerateRequest
    from baton.client import BatonClient
    try:
        from baton.local.cluster import LocalCluster
        from baton.local.spec import ClusterSpec
    except ImportError:  # a baseline from before baton.local
        from baton.gateway.local_cluster import ClusterSpec, LocalCluster
    from baton.model.hub import SHIPPED_MODEL_DIR
    from baton.model.loader import load_checkpoint
    from baton.sampling.params import SamplingParams

    tokenizer = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cpu").tokenizer
    source = tokenizer.encode(Path(os.__file__).read_text() + Path(json.__file__).read_text())
    spec = ClusterSpec(decode_workers=1, chain_ranks=2, prefill_threshold_tokens=128,
                       chain_break_even=False)
    ttft: dict[str, list[float]] = {}
    prefill: dict[str, list[float]] = {}  # the compute the final step reports (prefill_s)
    with tempfile.TemporaryDirectory() as logs, LocalCluster(spec, log_dir=Path(logs)) as cluster:
        client = BatonClient(cluster.gateway_address)
        client.wait_until_serving(timeout_s=60)
        client.generate(GenerateRequest(text="import os\n", sampling=SamplingParams(max_tokens=2)))
        index = first_prompt
        for _ in range(requests_per_cell):
            for length in LENGTHS:
                for route in ROUTES:
                    start = 37 * index % (len(source) - length)
                    index += 1
                    prompt = tuple(source[start:start + length])
                    request = GenerateRequest(token_ids=prompt, prefill_route=route,
                                              sampling=SamplingParams(temperature=0.0, max_tokens=8),
                                              compression=CompressionParams(enabled=False))
                    sent = time.perf_counter()
                    first = compute = None
                    for step in client.stream(request, timeout_s=120):
                        if first is None and step.token_ids:
                            first = time.perf_counter() - sent
                        if step.timings is not None:
                            compute = step.timings.prefill_s
                    ttft.setdefault(f"{route}/{length}", []).append(first)
                    prefill.setdefault(f"{route}/{length}", []).append(compute)
        client.close()
    return {"ttft_s": ttft, "prefill_s": prefill}


def run_round(tree: Path, requests_per_cell: int, first_prompt: int) -> dict:
    """One round in a fresh process importing baton from ``tree``."""
    environment = os.environ | {"PYTHONPATH": str(tree / "services")}
    output = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure",
                             str(requests_per_cell), "--first-prompt", str(first_prompt)],
                            cwd=tree, env=environment, check=True, capture_output=True, text=True)
    return json.loads(output.stdout.strip().splitlines()[-1])



def run(baseline: str, rounds: int, requests_per_cell: int) -> dict:
    baseline_commit = git("rev-parse", baseline)
    results = {"run": run_record(), "baseline": baseline_commit, "rounds": []}
    with tempfile.TemporaryDirectory() as scratch:
        worktree = Path(scratch) / "baseline"
        git("worktree", "add", "--detach", str(worktree), baseline_commit)
        try:
            trees = {"this": ROOT, "baseline": worktree}
            for number in range(rounds):
                order = ("this", "baseline") if number % 2 == 0 else ("baseline", "this")
                for name in order:  # both trees get the same new prompts in a round
                    measured = run_round(trees[name], requests_per_cell, number * 1000)
                    results["rounds"].append({"round": number + 1, "tree": name, **measured})
                    print(f"round {number + 1} {name}: done", flush=True)
        finally:
            git("worktree", "remove", "--force", str(worktree))
    results["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results["load_average_end"] = round(os.getloadavg()[0], 1)
    return results


def _overheads(entry: dict, cell: str) -> list[float]:
    """Each request's TTFT less the prefill compute its final step reports: what the route
    itself costs (admission, hops, the KV's trip), without the compute's own spread."""
    return [ttft - compute for ttft, compute in zip(entry["ttft_s"][cell], entry["prefill_s"][cell],
                                                     strict=True)]


def report(results: dict) -> str:
    cells = [f"{route}/{length}" for route in ROUTES for length in LENGTHS]
    trees = ("this", "baseline")
    pooled = {tree: {cell: [] for cell in cells} for tree in trees}
    overhead = {tree: {cell: [] for cell in cells} for tree in trees}
    per_round = {}
    for entry in results["rounds"]:
        for cell in cells:
            values = entry["ttft_s"][cell]
            pooled[entry["tree"]][cell] += values
            per_round.setdefault((cell, entry["round"]), {})[entry["tree"]] = statistics.median(values)
            if "prefill_s" in entry:
                overhead[entry["tree"]][cell] += _overheads(entry, cell)
    rows, overhead_rows = [], []
    for cell in cells:
        route, length = cell.split("/")
        this, base = statistics.median(pooled["this"][cell]), statistics.median(pooled["baseline"][cell])
        ratios = [values["this"] / values["baseline"] for (c, _), values in sorted(per_round.items())
                  if c == cell]
        rows.append([route, length, len(pooled["this"][cell]), f"{base * 1000:.0f}",
                     f"{this * 1000:.0f}", f"**{this / base:.2f}x**",
                     " / ".join(f"{r:.2f}" for r in ratios)])
        if overhead["this"][cell] and overhead["baseline"][cell]:
            this_ms = statistics.median(overhead["this"][cell]) * 1000
            base_ms = statistics.median(overhead["baseline"][cell]) * 1000
            overhead_rows.append([route, length, f"{base_ms:.1f}", f"{this_ms:.1f}",
                                  f"**{this_ms - base_ms:+.1f}**"])
    overhead_section = [] if not overhead_rows else [
        "",
        ("What the route itself costs: each request's TTFT less the prefill compute its final "
         "step reports (`timings.prefill_s`: the chain's, from its tail's receipt of the request "
         "to the logits, or the decode pod's, from arrival to its first token), so the compute's "
         "own spread between clusters drops out:"),
        "",
        markdown_table(["route", "prompt tokens", "baseline overhead P50 ms",
                        "this overhead P50 ms", "this - baseline ms"], overhead_rows),
    ]
    return "\n".join([
        report_header("Time to first token by route: this commit against its baseline",
                      "bench/route_ttft.py", "route-ttft", results,
                      f"python bench/route_ttft.py --baseline {results['baseline'][:12]} "
                      f"--rounds {max(e['round'] for e in results['rounds'])}"),
        (f"Baseline: commit `{results['baseline'][:12]}`. Finished {results['finished']}; load "
         f"average {results['load_average_end']} at the end."),
        "",
        ("Each round starts a fresh `LocalCluster` (gateway, a 2-rank chain, one decode pod; KV "
         "compression off; the chain's break-even off) from one tree, then sends prompts one at a "
         "time through the gateway's gRPC door, pinned to each route, every prompt new, 8 new "
         "tokens each, greedy. TTFT is the client's: request sent to first streamed token. The "
         "trees alternate round by round."),
        "",
        markdown_table(["route", "prompt tokens", "requests per tree", "baseline TTFT P50 ms",
                        "this TTFT P50 ms", "this / baseline", "per round"], rows),
        *overhead_section,
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="956553d~1", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=6, help="requests per route and length a round")
    parser.add_argument("--render", "--report-only", dest="render", action="store_true",
                        help="render the report again from the committed raw results")
    parser.add_argument("--measure", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--first-prompt", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.first_prompt)))
        return
    if not args.render:
        save_results("route-ttft", run(args.baseline, args.rounds, args.requests))
    write_report("route-ttft.md", report(load_results("route-ttft")))


if __name__ == "__main__":
    main()
