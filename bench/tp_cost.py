"""What tensor parallelism costs on one CPU host: the SARATHI engine on a model sharded over two
ranks (gloo, one thread each) against the same model in one process with one thread and with
two (the same cores), offline: every prompt queued at once, greedy, fp32. The configurations
alternate round by round in one process (the TP=2 leader is this process; its follower is
spawned once). Writes docs/benchmarks/tp-cost.md from tp-cost-results.json.gz.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.config import KVPoolConfig, SchedulerConfig
from baton.model.loader import load_checkpoint, save_checkpoint
from baton.model.presets import PRESETS, random_model
from baton.parallel.leader import start_group
from baton.sampling.params import SamplingParams
from baton.sarathi.engine import Engine
from common import (
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)

NAME = "tp-cost"
PRESET = "random-50m"  # 8 layers of 512, GQA 8/4, an MLP of 1,408
KV = KVPoolConfig(num_blocks=4096)
SCHEDULER = SchedulerConfig(token_budget=2048)  # fixed, so every configuration plans alike


def workload(num_prompts: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    vocab = PRESETS[PRESET].vocab_size
    lengths = torch.randint(64, 384, (num_prompts,), generator=generator).tolist()
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def run_once(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Every prompt at once; (generated tokens/s, each request's time to its first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    first: dict[str, float] = {}
    generated = 0
    while engine.has_work():
        for output in engine.step():
            generated += len(output.new_token_ids)
            if output.new_token_ids and output.request_id not in first:
                first[output.request_id] = time.perf_counter() - started
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "tokens_per_s": generated / elapsed,
            "ttft_s": [first[request_id] for request_id in ids]}


def measure(args: argparse.Namespace) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="baton-tp-cost-"))
    save_checkpoint(random_model(PRESET, seed=0), directory, dtype=torch.float32)
    single = load_checkpoint(str(directory), "float32", "cpu", with_tokenizer=False)
    sharded, followers = start_group(2, str(directory), "float32", "cpu", cpu_threads=1,
                                     with_tokenizer=False, timeout_s=300.0)
    # (name, engine, this process's threads)
    configurations = [("TP=1, 1 thread", Engine(single.model, kv=KV, scheduler=SCHEDULER), 1),
                      ("TP=1, 2 threads", Engine(single.model, kv=KV, scheduler=SCHEDULER), 2),
                      ("TP=2, 1 thread per rank", Engine(sharded.model, kv=KV, scheduler=SCHEDULER), 1)]
    raw: dict[str, list[dict]] = {name: [] for name, _, _ in configurations}
    started = time.monotonic()
    try:
        for name, engine, threads in configurations:  # warm-up: kernels, packed weights
            torch.set_num_threads(threads)
            run_once(engine, workload(4, seed=99), 4)
        for round_index in range(args.rounds):
            prompts = workload(args.prompts, seed=round_index)
            order = configurations if round_index % 2 == 0 else list(reversed(configurations))
            for name, engine, threads in order:
                torch.set_num_threads(threads)
                raw[name].append(run_once(engine, prompts, args.new_tokens))
    finally:
        followers.close()
    return {"run": run_record(), "rounds": args.rounds, "prompts": args.prompts,
            "new_tokens": args.new_tokens, "seconds": time.monotonic() - started, "runs": raw}


def report(results: dict) -> str:
    runs = results["runs"]
    base = statistics.median(run["tokens_per_s"] for run in runs["TP=1, 2 threads"])
    rows = []
    for name, by_round in runs.items():
        tokens_per_s = [run["tokens_per_s"] for run in by_round]
        ttft = statistics.median(statistics.median(run["ttft_s"]) for run in by_round)
        seconds = statistics.median(run["seconds"] for run in by_round)
        rows.append([name, len(by_round), f"{seconds:.1f}",
                     " / ".join(f"{value:.0f}" for value in tokens_per_s),
                     f"{statistics.median(tokens_per_s) / base:.2f}", f"{ttft:.2f}"])
    return "\n".join([
        report_header("The cost of tensor parallelism on one CPU host", "bench/tp_cost.py", NAME,
                      results),
        (f"{results['rounds']} interleaved rounds; each: {results['prompts']} prompts of 64-383 "
         f"random tokens queued at once, {results['new_tokens']} greedy new tokens each, fp32, "
         f"{PRESET} (random weights), token budget {SCHEDULER.token_budget}; "
         f"{results['seconds']:.0f} s in all. TP=2: two processes over gloo on this host's cores."),
        "",
        markdown_table(["configuration", "rounds", "run (s, median)", "tokens/s per round",
                        "tokens/s / TP=1 on 2 threads", "TTFT P50 (s, median of rounds)"], rows),
        "",
        ("Here both ranks share the cores one process would use, and each layer adds two "
         "all-reduces and each step a message to the follower: the figures are the price of "
         "sharding where it buys no memory (on GPUs it is what lets a model larger than one "
         "device run at all)."),
        "",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--render", action="store_true", help="only render the committed results")
    args = parser.parse_args()
    if not args.render:
        save_results(NAME, measure(args))
    write_report(f"{NAME}.md", report(load_results(NAME)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
