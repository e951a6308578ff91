"""SARATHI vs its two baselines on the decode engine: throughput and time between tokens.

Writes docs/benchmarks/sarathi.md and sarathi_*.png. Workload (the paper's):
B requests in the system at all times (a finished request is replaced at once
until N have been served), each with a P-token prompt and D generated tokens,
greedy. Policies: ``sarathi`` (decode-maximal batches, chunked prefill),
``separate`` (prefill-only and decode-only iterations) and ``orca`` (whole
prefills mixed into decode batches), all in the same engine.

Measures, per run, over the steady-state window (from the moment the first B
requests have finished to the arrival of the last one, so that neither the
start-up burst of B prompts nor the draining tail counts):
* end-to-end throughput = (prompt + generated tokens computed) / window time;
* decode throughput = decode tokens / decode time, where a mixed iteration's
  decode time is its time minus the time a prefill-only iteration of the same
  number of prompt tokens takes (the paper's marginal cost of piggybacked
  decodes), measured in a shadow engine right after each mixed iteration;
* whole-run throughput = all tokens / wall time, ramp-up and drain included;
* time between tokens (TBT) of every request over the whole run, P50 and P99.

    .venv/bin/python bench/sarathi.py            # ~50M random model and the shipped one
    .venv/bin/python bench/sarathi.py --quick    # a smaller grid, for a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.config import KVPoolConfig, SchedulerConfig
from baton.model import load_checkpoint
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.presets import random_model
from baton.sampling.params import SamplingParams
from baton.sarathi import Engine
from baton.sarathi.budget import CANDIDATES, iteration_s, measure_token_budget
from common import load_results, report_header, run_record, save_results, write_report
from sarathi_report import (
    ITERATION_INTRO,
    POLICIES,
    goal_check,
    iteration_table,
    plot,
    table,
)
from sarathi_results import IterationCosts, RunStats, Workload


class PairedPrefillCost:
    """Seconds of a prefill-only iteration of n prompt tokens, measured right after the
    mixed iteration it is subtracted from.

    A shadow engine (same model, same pool layout, the same code path: paged pool, runner,
    sampling of the final token) runs a fresh n-token prompt as one prefill-only
    iteration. Pairing each mixed iteration with its own measurement moments later keeps
    the machine's drift (other jobs, caches, clocks) out of the difference, which is a
    few percent of either time: a calibration table taken minutes earlier swamped it.
    """

    def __init__(self, model, max_tokens: int) -> None:
        config = SchedulerConfig(policy="separate", token_budget=max(max_tokens, 2), max_running=1)
        num_blocks = model.config.num_hidden_layers * (max_tokens // 16 + 2)
        self.engine = Engine(model, None, scheduler=config,
                             kv=KVPoolConfig(block_size=16, num_blocks=num_blocks))
        self.vocab_size = model.config.vocab_size
        self.params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        self(max_tokens)  # warm up

    def __call__(self, num_tokens: int) -> float:
        self.engine.add_request(torch.randint(0, self.vocab_size, (num_tokens,)).tolist(), self.params)
        began = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - began


def served_engine(model, scheduler: SchedulerConfig, kv: KVPoolConfig) -> Engine:
    """An engine as a decode pod runs it: on a GPU, its decode steps' CUDA graphs captured
    before the clock starts (as the pod does before it serves)."""
    engine = Engine(model, None, scheduler=scheduler, kv=kv)
    if engine.runner.graphs is not None:
        engine.runner.graphs.capture_all()
    return engine


def iteration_costs(model, batch: int, budget: int, rounds: int = 12) -> IterationCosts:
    """SARATHI's per-batch measurement: a decode-maximal batch against its parts.

    B-1 sequences decode; each round times one decode-only iteration, one mixed
    iteration (a fresh prompt of exactly C-(B-1) tokens joins as one chunk) and the same
    chunk as a prefill-only iteration in a shadow engine, back to back, so that the
    machine's drift falls on all three alike. Medians over ``rounds``.
    """
    chunk = budget - (batch - 1)
    kv = KVPoolConfig(block_size=16, num_blocks=model.config.num_hidden_layers * (batch + 1) * 40)
    engine = served_engine(model, SchedulerConfig(policy="sarathi", token_budget=budget,
                                                  max_running=batch), kv)
    shadow = PairedPrefillCost(model, chunk)
    generator = torch.Generator().manual_seed(0)

    def prompt(length: int) -> list[int]:
        return torch.randint(0, model.config.vocab_size, (length,), generator=generator).tolist()

    for _ in range(batch - 1):
        engine.add_request(prompt(128), SamplingParams(  # decode for as long as the context allows
            temperature=0.0, max_tokens=model.config.max_position_embeddings - 128, ignore_eos=True))
    while len(engine.scheduler.running) < batch - 1:  # requests reach the scheduler at step()
        engine.step()
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    decode_s, mixed_s, prefill_s = [], [], []
    for _ in range(rounds + 1):  # the first round warms up
        began = time.perf_counter()
        engine.step()
        decode_s.append(time.perf_counter() - began)
        engine.add_request(prompt(chunk), one_token)
        began = time.perf_counter()
        engine.step()
        mixed_s.append(time.perf_counter() - began)
        assert engine.last_plan.num_prefill_tokens == chunk and len(engine.last_plan.decodes) == batch - 1
        prefill_s.append(shadow(chunk))
    return IterationCosts(batch, budget, *(float(np.median(x[1:])) for x in (decode_s, mixed_s, prefill_s)))


def run(model, policy: str, workload: Workload, prefill_cost: PairedPrefillCost) -> RunStats:
    config = SchedulerConfig(policy=policy, token_budget=workload.budget, max_running=workload.batch)
    tokens_per_seq = workload.prompt_len + workload.decode_len
    num_blocks = model.config.num_hidden_layers * (workload.batch + 1) * (tokens_per_seq // 16 + 2)
    engine = served_engine(model, config, KVPoolConfig(block_size=16, num_blocks=num_blocks))
    params = SamplingParams(temperature=0.0, max_tokens=workload.decode_len, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)

    def submit() -> None:
        engine.add_request(torch.randint(0, model.config.vocab_size, (workload.prompt_len,),
                                         generator=generator).tolist(), params)

    for _ in range(workload.batch):
        submit()
    submitted, finished = workload.batch, 0
    last_token_at: dict[str, float] = {}
    stats = RunStats(policy, workload)
    shadow_s = 0.0  # time spent measuring prefill-only iterations, kept off every clock

    def clock() -> float:
        return time.perf_counter() - shadow_s

    start = clock()
    while finished < workload.num_requests:
        in_window = finished >= workload.batch and submitted < workload.num_requests
        began = clock()
        outputs = engine.step()
        now = clock()
        plan = engine.last_plan
        for output in outputs:
            if output.request_id in last_token_at:
                stats.tbt_s.append(now - last_token_at[output.request_id])
            last_token_at[output.request_id] = now
            if output.finished:
                finished += 1
                if submitted < workload.num_requests:
                    submit()
                    submitted += 1
        if in_window:
            stats.window_s += now - began
            stats.window_prompt_tokens += plan.num_prefill_tokens
            stats.window_decode_tokens += len(plan.decodes)
            if plan.decodes and plan.prefills:
                # Signed: the pairs' noise averages out over the window only if unclipped.
                measured_at = time.perf_counter()
                stats.window_decode_s += now - began - prefill_cost(plan.num_prefill_tokens)
                shadow_s += time.perf_counter() - measured_at
            elif plan.decodes:
                stats.window_decode_s += now - began
    stats.wall_s = clock() - start
    stats.iterations = engine.num_iterations
    return stats


def sweep(model, workloads: list[Workload], label: str, repeats: int,
          measured: dict[tuple, dict[str, RunStats]]) -> list[RunStats]:
    """Every (workload, policy) ``repeats`` times, policies interleaved so that a burst of load
    from other jobs hits them alike; the fastest end-to-end run of each is kept. A workload
    already in ``measured`` (the same point on another axis) is not run again."""
    prefill_cost = PairedPrefillCost(model, max(max(w.prompt_len, w.budget) for w in workloads))
    results = []
    for workload in workloads:
        if workload.key not in measured:
            best: dict[str, RunStats] = {}
            for _ in range(repeats):
                for policy in POLICIES:
                    stats = run(model, policy, workload, prefill_cost)
                    if policy not in best or stats.end_to_end_tps > best[policy].end_to_end_tps:
                        best[policy] = stats
            measured[workload.key] = best
        for policy in POLICIES:
            stats = measured[workload.key][policy]
            results.append(stats)
            print(f"[{label}] {policy:8s} B={workload.batch} P={workload.prompt_len} D={workload.decode_len} "
                  f"C={workload.budget}: decode {stats.decode_tps:7.1f} tok/s, e2e {stats.end_to_end_tps:7.1f} "
                  f"tok/s, TBT p50 {stats.tbt_ms(50):6.1f} ms p99 {stats.tbt_ms(99):6.1f} ms", flush=True)
    return results


def device_sized_budget(model, slack: float = 1.1) -> tuple[int, dict[int, float]]:
    """The smallest token budget whose prompt tokens cost at most ``slack`` times the cheapest
    per-token cost of any budget up to half the model's context: the chunk that fills the
    device (SARATHI sizes its chunks so; a larger one prefills no faster per token, only makes
    decodes wait longer). Returns it and every budget's seconds per prompt token."""
    # at most half the context: the balanced point's prompt (~C tokens) and its decodes must
    # fit it, and iteration_costs' pool must hold a C-token chunk beside the B-1 decodes
    per_token = {budget: iteration_s(model, budget) / budget for budget in CANDIDATES
                 if 2 * budget <= model.config.max_position_embeddings}
    for budget, cost in per_token.items():
        print(f"[budget] C={budget}: {cost * 1e6:.1f} us per prompt token", flush=True)
    cheapest = min(per_token.values())
    return min(budget for budget, cost in per_token.items() if cost <= slack * cheapest), per_token


def balanced_workload(batch: int, budget: int, chunks: int, num_requests: int) -> Workload:
    """SARATHI's balanced point: with B-1 decodes running, each iteration has room for a
    chunk of C-(B-1) prompt tokens; a prompt of ``chunks`` such chunks takes ``chunks``
    iterations, during which each of the B-1 decodes makes ``chunks`` tokens. One request
    then leaves as one enters when D - 1 = chunks * (B-1), i.e. P:D ~ (C-(B-1))/(B-1),
    the paper's C/(B-1) with the chunk counted inside the budget."""
    chunk = budget - (batch - 1)
    return Workload(batch, chunks * chunk, chunks * (batch - 1) + 1, budget, num_requests, balanced=True)


def grids(quick: bool, auto_budget: int, budget: int = 256,
          max_tokens: int | None = None) -> dict[str, list[Workload]]:
    """The full grid for a quiet machine: P:D around the balanced point (B=8, C=``budget``),
    the token budget (128/256/512 and the one the engine's rule picks, ``auto_budget``) and
    the batch size (4/8/16) at their balanced points. ``quick``: the P:D sweep and the picked
    budget only, one-chunk prompts and fewer requests. Workloads whose sequences would pass
    ``max_tokens`` (the model's context) are left out."""
    batch = 8
    chunks = 1 if quick else 2
    num_requests = (lambda b: 3 * b) if quick else (lambda b: 4 * b)
    middle = balanced_workload(batch, budget, chunks, num_requests(batch))
    prompt = middle.prompt_len

    def with_ratio(ratio: float) -> Workload:
        return Workload(batch, prompt, max(2, round(prompt / ratio)), budget, num_requests(batch))

    ratios = (10, 100) if quick else (10, 25, 50, 100)
    ratio_sweep = sorted([with_ratio(r) for r in ratios] + [middle], key=lambda w: w.ratio)
    grid = {"ratio": ratio_sweep}
    budgets = [auto_budget] if quick else sorted({128, 256, 512, auto_budget})
    grid["chunk"] = [balanced_workload(batch, c, chunks, num_requests(batch)) for c in budgets]
    if not quick:
        grid["batch"] = [balanced_workload(b, budget, chunks, num_requests(b)) for b in (4, 8, 16)]
    if max_tokens is not None:
        grid = {axis: [w for w in workloads if w.prompt_len + w.decode_len <= max_tokens]
                for axis, workloads in grid.items()}
    return {axis: workloads for axis, workloads in grid.items() if workloads}


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    record = run_record()
    on_gpu = args.device == "cuda"
    dtype_name = args.dtype or ("bfloat16" if on_gpu else "float32")
    dtype = getattr(torch, dtype_name)
    main_label = args.model
    models = [(main_label, random_model(main_label, dtype=dtype, device=args.device,
                                        draw_on_device=main_label != "random-50m"))]
    budget, per_token = 256, None  # the balanced point's budget: 256, or the device's for random-1b
    if main_label != "random-50m":
        budget, per_token = device_sized_budget(models[0][1])
        print(f"[budget] device-sized budget for {main_label}: C={budget}", flush=True)
    elif (SHIPPED_MODEL_DIR / "config.json").is_file():
        models.append(("shipped", load_checkpoint("", dtype=dtype_name, device=args.device).model))
    # The budget the engine picks by default (SARATHI's rule, measured on this machine).
    auto_budget = measure_token_budget(models[0][1], SchedulerConfig().target_iteration_ms)
    print(f"[budget] the engine's rule picks C={auto_budget} for {main_label}", flush=True)
    started = time.perf_counter()
    points = ((4, 256), (8, 256), (16, 256), (8, 128), (8, 512)) if budget == 256 else ((8, budget), (8, 256))
    costs = [iteration_costs(models[0][1], b, c) for b, c in points]
    for c in costs:
        print(f"[iteration] B={c.batch} C={c.budget}: chunk {c.prefill_only_s * 1e3:.1f} ms, mixed "
              f"{c.mixed_s * 1e3:.1f} ms, decodes alone {c.decode_only_s * 1e3:.1f} ms", flush=True)
    sweeps = []
    for label, model in models:
        measured: dict[tuple, dict[str, RunStats]] = {}
        grid = grids(args.quick, auto_budget, budget, model.config.max_position_embeddings)
        if label == "shipped":
            grid = {"ratio": grid["ratio"]}
        for axis, workloads in grid.items():
            runs = sweep(model, workloads, f"{label}/{axis}", args.repeats, measured)
            sweeps.append({"model": label, "axis": axis, "runs": [asdict(r) for r in runs]})
    return {"run": record, "device": args.device, "dtype": dtype_name, "threads": args.threads,
            "repeats": args.repeats, "model": main_label, "budget": budget, "per_token_s": per_token,
            "auto_budget": auto_budget, "target_iteration_ms": SchedulerConfig().target_iteration_ms,
            "costs": [asdict(c) for c in costs], "sweeps": sweeps,
            "elapsed_s": time.perf_counter() - started,
            "load_average_end": round(os.getloadavg()[0], 1)}


def _run_stats(entry: dict) -> RunStats:
    return RunStats(**{**entry, "workload": Workload(**entry["workload"])})


def render(results: dict, prefix: str) -> str:
    on_gpu, main_label, budget = results["device"] == "cuda", results["model"], results["budget"]
    precision = (f"GPU run, {results['dtype']}" if on_gpu
                 else f"{results['threads']} threads, {results['dtype']}")
    header = report_header(f"SARATHI decode engine{' on a GPU' if on_gpu else ''}: throughput and "
                           f"time between tokens", "bench/sarathi.py", prefix, results)
    sections = [(f"{header}\n{precision}; each (workload, policy) ran {results['repeats']} "
                 f"times, policies interleaved, the fastest run kept.\n")]
    costs = [IterationCosts(**c) for c in results["costs"]]
    balanced_runs: list[RunStats] = []
    for entry in results["sweeps"]:
        label, axis = entry["model"], entry["axis"]
        runs = [_run_stats(r) for r in entry["runs"]]
        if label == main_label:
            balanced_runs += [r for r in runs if r.workload.balanced
                              and r.workload.key not in {b.workload.key for b in balanced_runs}]
        if axis == "ratio":
            png = plot(runs, lambda w: w.ratio, "P:D", f"{prefix}_{label}_ratio.png",
                       f"{label}: B=8, C={budget}, P={runs[0].workload.prompt_len}")
        elif axis == "chunk":
            png = plot(runs, lambda w: w.budget, "token budget C (balanced P:D = C/(B-1))",
                       f"{prefix}_{label}_chunk.png", f"{label}: B=8")
        else:
            png = plot(runs, lambda w: w.batch, "batch size B (balanced P:D = C/(B-1))",
                       f"{prefix}_{label}_batch.png", f"{label}: C={budget}")
        sections.append(f"## {label}: sweep over {axis}\n\n{table(runs)}\n\n![{axis}]({png})\n")
    budget_line = (f"The engine's default budget rule (the largest whose iteration meets "
                   f"{results['target_iteration_ms']:.0f} ms, `baton.sarathi.budget`) picks "
                   f"**C={results['auto_budget']}** for {main_label} on this machine.\n\n")
    if results["per_token_s"]:
        budget_line += (f"The balanced point below takes the device-sized budget instead, "
                        f"**C={budget}**: the smallest whose prompt tokens cost at most 1.1x the "
                        f"cheapest per-token cost of any budget ("
                        + ", ".join(f"C={c}: {s * 1e6:.1f}" for c, s in results["per_token_s"].items())
                        + " µs per token).\n\n")
    sections.insert(1, budget_line + goal_check(balanced_runs, costs, main_label, budget)
                    + ITERATION_INTRO.replace("MODEL", main_label) + iteration_table(costs) + "\n")
    sections.append(f"Total benchmark time: {results['elapsed_s']:.0f} s; load average "
                    f"{results['load_average_end']:.1f} at the end.\n")
    return "\n".join(sections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs per (workload, policy); best kept")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: a GPU run in bfloat16, written to sarathi-gpu.md")
    parser.add_argument("--model", choices=("random-50m", "random-1b"), default="random-50m",
                        help="random-1b: Llama 3.2 1B's shape, drawn on the device, with the "
                             "device-sized token budget as its balanced point (a GPU run, "
                             "written to sarathi-gpu-1b.md)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="the model's dtype (default: float32 on a CPU, the reference run in "
                             "sarathi.md; bfloat16 on a GPU). A CPU run in bfloat16, the dtype "
                             "`auto` picks on CPUs with AVX512-BF16, is written to sarathi-bf16.md")
    parser.add_argument("--render", action="store_true",
                        help="render the report again from the committed raw results")
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    dtype_name = args.dtype or ("bfloat16" if on_gpu else "float32")
    prefix = "sarathi-gpu" if on_gpu else ("sarathi" if dtype_name == "float32" else "sarathi-bf16")
    if args.model != "random-50m":
        prefix += "-" + args.model.removeprefix("random-")
    if not args.render:
        save_results(prefix, measure(args))
    write_report(f"{prefix}.md", render(load_results(prefix), prefix))


if __name__ == "__main__":
    main()
