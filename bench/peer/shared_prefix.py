"""baton against vLLM where prompts share prefixes, both with their prefix caches on.

One question: on work where prompts repeat (documents asked several questions, as RAG,
shared system prompts and few-shot templates make it), how does baton's engine compare
with vLLM's at vLLM's defaults (prefix cache on), and does baton's cache cost anything on
work that never repeats?

* **Shared prefixes** (``workload.make_shared_prefix_workload``): 4 groups of 8 documents of
  660-700 tokens, each asked 8 questions of 40-140 tokens, questions interleaved across
  documents, 64 new tokens each, greedy, end-of-sequence ignored: 256 requests, all
  submitted at once. vLLM at its defaults against baton at its defaults (both caches on),
  offline, fresh processes, the order flipping every round. In fp32 both must produce
  identical tokens, or the run fails.
* **No reuse** (the peer workload's first 256 prompts): baton with its prefix cache on
  against off, interleaved the same way, identical tokens required.

Raw results: docs/benchmarks/peer-prefix-results.json.gz; the report,
docs/benchmarks/peer-prefix.md, is rendered from that file alone (``--render``).

usage: python bench/peer/shared_prefix.py [--rounds 3] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results as raw
from common import report_header, run_record, write_report
from report import percentile, ratios, throughput
from run import WORK_DIR, check_identical, prepare_shipped_model, run_offline
from vllm_setup import ensure_peer_venv
from workload import Workload, make_shared_prefix_workload, make_workload

ROOT = Path(__file__).resolve().parents[2]
RESULTS_PATH = ROOT / "docs" / "benchmarks" / "peer-prefix-results.json.gz"
REPORT_NAME = "peer-prefix.md"
NUM_REQUESTS = 256
DEFAULTS = {"token_budget": 0, "max_seqs": 0}  # each system's own defaults, caches on
CACHE_OFF = {**DEFAULTS, "prefix_cache": False}
# The shared-prefix runs of a round: vLLM, baton, and baton with its cache off (what it gains)
SHARED_SETTINGS = {"vllm": ("vllm", DEFAULTS), "baton": ("baton", DEFAULTS),
                   "baton-off": ("baton", CACHE_OFF)}
SHARED_RUNS = tuple(SHARED_SETTINGS)
GOAL_THROUGHPUT = 1.3  # baton / vLLM generated tokens/s, shared prefixes
GOAL_TTFT = 0.8  # baton / vLLM TTFT P50, shared prefixes
GOAL_NO_REUSE = 0.97  # baton cache on / off, no reuse


def prepare_workloads() -> tuple[Path, Path]:
    from baton.model.hub import SHIPPED_MODEL_DIR
    from baton.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(SHIPPED_MODEL_DIR)
    shared = make_shared_prefix_workload(tokenizer).save(WORK_DIR / "shared-prefix.json")
    no_reuse = make_workload(tokenizer, num_requests=NUM_REQUESTS).save(WORK_DIR / "no-reuse.json")
    return shared, no_reuse


def measure(rounds: int, dtypes: list[str]) -> dict:
    peer_python = ensure_peer_venv()
    model_dir = prepare_shipped_model()
    shared, no_reuse = prepare_workloads()
    results = {"run": run_record(),
               "workloads": {"shared": describe(shared), "no_reuse": describe(no_reuse)},
               "shared": [], "no_reuse": []}
    for dtype in dtypes:
        for index in range(rounds):
            print(f"shared prefixes {dtype} round {index + 1}/{rounds}", flush=True)
            order = SHARED_RUNS if index % 2 == 0 else SHARED_RUNS[::-1]
            runs = {name: run_offline(SHARED_SETTINGS[name][0], peer_python, model_dir, shared, dtype,
                                      SHARED_SETTINGS[name][1],
                                      WORK_DIR / f"prefix-{dtype}-{index}-{name}.json")
                    for name in order}
            if dtype == "float32":
                for name in ("baton", "baton-off"):
                    check_identical(f"shared prefixes round {index + 1} ({name})",
                                    runs["vllm"]["token_ids"], runs[name]["token_ids"])
            results["shared"].append({name: raw.offline_run(runs[name]) for name in order})
    for index in range(rounds):
        print(f"no reuse, baton cache on/off round {index + 1}/{rounds}", flush=True)
        settings = {"on": DEFAULTS, "off": CACHE_OFF}
        order = ("on", "off") if index % 2 == 0 else ("off", "on")
        runs = {name: run_offline("baton", peer_python, model_dir, no_reuse, "float32", settings[name],
                                  WORK_DIR / f"no-reuse-{index}-{name}.json")
                for name in order}
        check_identical(f"no reuse round {index + 1}", runs["off"]["token_ids"], runs["on"]["token_ids"])
        results["no_reuse"].append({name: raw.offline_run(runs[name]) for name in order})
    return results


def describe(path: Path) -> dict:
    workload = Workload.load(path)
    lengths = [len(prompt) for prompt in workload.prompts]
    return {"requests": len(lengths), "prompt_tokens": sum(lengths), "min_prompt": min(lengths),
            "max_prompt": max(lengths), "new_tokens": workload.new_tokens}


# --- the report (from the raw results alone) ------------------------------------------------


def off_cells(runs: dict, baton: dict) -> str:
    """The cache-off run's cells of a shared-prefix round (runs before it had none)."""
    off = runs.get("baton-off")
    if off is None:
        return "- | - |"
    return f"{throughput(off):,.0f} | {throughput(baton) / throughput(off):.2f}x |"


def render(results: dict) -> str:
    shared, no_reuse = results["workloads"]["shared"], results["workloads"]["no_reuse"]
    lines = [
        report_header("baton and vLLM where prompts share prefixes", "bench/peer/shared_prefix.py",
                      "peer-prefix", results),
        (f"* **Shared prefixes**: {shared['requests']} requests, {shared['prompt_tokens']:,} prompt "
        f"tokens ({shared['min_prompt']}-{shared['max_prompt']} each): 4 groups of 8 documents "
        "of 660-700 tokens, each asked 8 questions of 40-140 tokens, interleaved, "
        f"{shared['new_tokens']} new tokens each, greedy. vLLM's engine at its defaults (prefix "
        "cache on) against baton's at its defaults (prefix cache on), every request submitted at "
        "once, 2 threads, fresh processes, the order flipping every round; and baton with its "
        "cache off, for what the cache gains it."),
        (f"* **No reuse**: the peer workload's first {no_reuse['requests']} prompts "
        f"({no_reuse['prompt_tokens']:,} tokens): baton with its prefix cache on against off."),
        "",
        "## Shared prefixes",
        "",
        ("| dtype | round | vLLM tok/s | baton tok/s | baton / vLLM | vLLM TTFT P50 | baton TTFT P50 "
         "| baton / vLLM | identical tokens | baton, cache off tok/s | baton cache on / off |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_dtype: dict[str, list[tuple[float, float]]] = {}
    for index, runs in enumerate(results["shared"]):
        vllm, baton = runs["vllm"], runs["baton"]
        dtype = vllm["dtype"]
        speed = throughput(baton) / throughput(vllm)
        ttft = (percentile(baton["ttft_ms"], 0.5) / percentile(vllm["ttft_ms"], 0.5))
        by_dtype.setdefault(dtype, []).append((speed, ttft))
        same = sum(a == b for a, b in zip(vllm["token_digests"], baton["token_digests"]))
        lines.append(f"| {dtype} | {len(by_dtype[dtype])} | {throughput(vllm):,.0f} | "
                     f"{throughput(baton):,.0f} | {speed:.2f}x | "
                     f"{percentile(vllm['ttft_ms'], 0.5):,.0f} ms | "
                     f"{percentile(baton['ttft_ms'], 0.5):,.0f} ms | {ttft:.2f}x | "
                     f"{same}/{len(vllm['token_digests'])} | {off_cells(runs, baton)}")
    lines += ["", "| dtype | baton / vLLM tok/s, median (rounds) | goal | baton / vLLM TTFT P50 | goal |",
              "|---|---|---|---|---|"]
    for dtype, pairs in by_dtype.items():
        speeds, ttfts = [p[0] for p in pairs], [p[1] for p in pairs]
        lines.append(f"| {dtype} | {ratios(speeds)} | >= {GOAL_THROUGHPUT}x "
                     f"{'met' if statistics.median(speeds) >= GOAL_THROUGHPUT else 'missed'} | "
                     f"{ratios(ttfts)} | <= {GOAL_TTFT}x "
                     f"{'met' if statistics.median(ttfts) <= GOAL_TTFT else 'missed'} |")
    lines += ["", "Run lengths (wall seconds of the timed window): " + ", ".join(
        f"{runs[s]['wall_s']:.1f}" for runs in results["shared"] for s in ("vllm", "baton")) + ".",
        "", "## No reuse: baton's prefix cache on against off", "",
        "| round | cache off tok/s | cache on tok/s | on / off | identical tokens |", "|---|---|---|---|---|"]
    on_off = []
    for index, runs in enumerate(results["no_reuse"], start=1):
        on, off = runs["on"], runs["off"]
        on_off.append(throughput(on) / throughput(off))
        same = sum(a == b for a, b in zip(on["token_digests"], off["token_digests"]))
        lines.append(f"| {index} | {throughput(off):,.0f} | {throughput(on):,.0f} | {on_off[-1]:.2f}x | "
                     f"{same}/{len(on['token_digests'])} |")
    lines += ["", (f"On / off, median: {ratios(on_off)}; goal >= {GOAL_NO_REUSE}x "
              f"{'met' if statistics.median(on_off) >= GOAL_NO_REUSE else 'missed'}."), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--render", "--report-only", dest="render", action="store_true",
                        help="render the report from the committed raw results")
    args = parser.parse_args()
    if not args.render:
        WORK_DIR.mkdir(parents=True, exist_ok=True)
        raw.save(measure(args.rounds, args.dtypes.split(",")), RESULTS_PATH)
    write_report(REPORT_NAME, render(raw.load(RESULTS_PATH)))


if __name__ == "__main__":
    main()
