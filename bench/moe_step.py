"""What a mixture of experts costs a decode step against a dense model with the same active
parameters: Qwen3-MoE-shaped layers (8 experts, top-2, each expert half the dense MLP's
width) beside the same model with one dense MLP of the full width, both of random weights,
in one in-process SARATHI engine each, at 1, 8 and 32 greedy streams. The two alternate
round by round. Writes docs/benchmarks/moe-step.md from moe-step-results.json.gz.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.config import KVPoolConfig
from baton.model.presets import PRESETS, random_model
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

NAME = "moe-step"
CONCURRENCY = (1, 8, 32)
DENSE = PRESETS["random-50m"]  # 8 layers of 512, an MLP of 1,408
MOE = dataclasses.replace(DENSE, architecture="Qwen3MoeForCausalLM", num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=DENSE.intermediate_size // 2)


def decode_step_times(engine: Engine, concurrency: int, new_tokens: int, seed: int) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(concurrency):
        prompt = torch.randint(0, DENSE.vocab_size, (32,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                  ignore_eos=True))
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        plan = engine.last_plan
        if plan is not None and not plan.prefills and len(plan.decodes) == concurrency:
            times.append(elapsed)
    return times


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    engines = {name: Engine(random_model(config, seed=0), kv=KVPoolConfig(num_blocks=2048))
               for name, config in (("dense", DENSE), ("moe", MOE))}
    for engine in engines.values():
        decode_step_times(engine, 2, 4, seed=0)  # warm-up
    raw = {str(c): {name: [] for name in engines} for c in CONCURRENCY}
    started = time.monotonic()
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for concurrency in CONCURRENCY:
            for name in order:
                raw[str(concurrency)][name] += decode_step_times(engines[name], concurrency,
                                                                 args.new_tokens, round_index)
    return {"run": run_record(), "rounds": args.rounds, "new_tokens": args.new_tokens,
            "threads": args.threads, "seconds": time.monotonic() - started, "step_s": raw,
            "active_mlp": {"dense": DENSE.intermediate_size,
                           "moe": MOE.num_experts_per_tok * MOE.expert_intermediate_size}}


def report(results: dict) -> str:
    rows = []
    for concurrency, by_model in results["step_s"].items():
        dense = statistics.median(by_model["dense"])
        moe = statistics.median(by_model["moe"])
        rows.append([concurrency, len(by_model["moe"]), f"{dense * 1000:.2f}", f"{moe * 1000:.2f}",
                     f"{moe / dense:.2f}"])
    return "\n".join([
        report_header("A mixture of experts' decode step", "bench/moe_step.py", NAME, results),
        (f"{results['rounds']} interleaved rounds of {results['new_tokens']} new tokens per stream, "
         f"{results['threads']} torch thread(s), {results['seconds']:.0f} s in all. Dense: 8 layers "
         f"of 512 (random-50m), an MLP of {results['active_mlp']['dense']}; MoE: the same with 8 "
         f"experts of {results['active_mlp']['moe'] // 2}, top-2 (the same active MLP width)."),
        "",
        markdown_table(["streams", "steps", "dense median (ms)", "MoE median (ms)", "MoE / dense"], rows),
        "",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--render", action="store_true", help="only render the committed results")
    args = parser.parse_args()
    if not args.render:
        save_results(NAME, measure(args))
    write_report(f"{NAME}.md", report(load_results(NAME)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
