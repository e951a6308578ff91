"""What sampling controls cost a decode step: inter-token latency with a JSON-schema grammar,
with penalties (repetition, frequency, presence) and with neither, at 1, 8 and 32 streams.

The shipped model in one in-process SARATHI engine (the decode pod's), every stream seeded at
temperature 0.8 with 32 prompt tokens and a fixed number of new tokens; the grammar is an
unbounded array of small objects, so no stream ends early. The inter-token latency is the
time of each decode-only step (every running stream gets its next token from it); the three
settings alternate round by round. Writes docs/benchmarks/sampling-cost.md from
sampling-cost-results.json.gz.

Note: the shipped tokenizer has 4,096 ids; a grammar's mask costs grow with the vocabulary
(docs/runtime-log.md has the per-row costs at 32k ids).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.config import KVPoolConfig
from baton.model import load_checkpoint
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.sampling.grammar import GrammarSpec
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

NAME = "sampling-cost"
SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "name": {"type": "string", "maxLength": 12},
    "kind": {"enum": ["file", "dir", "link"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["id", "name", "kind", "tags"]}, "minItems": 200}  # never closed within a run
SETTINGS = ("plain", "json_schema", "penalties")
CONCURRENCY = (1, 8, 32)


def sampling(setting: str, seed: int, new_tokens: int) -> SamplingParams:
    common = {"temperature": 0.8, "seed": seed, "max_tokens": new_tokens, "ignore_eos": True}
    if setting == "json_schema":
        return SamplingParams(**common, structured=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    if setting == "penalties":
        return SamplingParams(**common, repetition_penalty=1.1, frequency_penalty=0.5,
                              presence_penalty=0.5)
    return SamplingParams(**common)


def decode_step_times(engine: Engine, prompts: list[list[int]], setting: str,
                      new_tokens: int) -> list[float]:
    """Seconds of every decode-only step while all the streams run."""
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, sampling(setting, index, new_tokens))
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        plan = engine.last_plan
        if plan is not None and not plan.prefills and len(plan.decodes) == len(prompts):
            times.append(elapsed)
    return times


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    loaded = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cpu")
    engine = Engine(loaded.model, loaded.tokenizer, kv=KVPoolConfig(num_blocks=1024))
    source = loaded.tokenizer.encode(Path(json.__file__).read_text() * 4)
    raw: dict = {str(c): {s: [] for s in SETTINGS} for c in CONCURRENCY}
    decode_step_times(engine, [source[:32]], "json_schema", 8)  # warm-up: compile, kernels
    started = time.monotonic()
    for round_index in range(args.rounds):
        for concurrency in CONCURRENCY:
            prompts = [source[i * 40 + round_index: i * 40 + round_index + 32] for i in range(concurrency)]
            order = SETTINGS if round_index % 2 == 0 else tuple(reversed(SETTINGS))
            for setting in order:
                raw[str(concurrency)][setting] += decode_step_times(engine, prompts, setting,
                                                                    args.new_tokens)
    return {"run": run_record(), "rounds": args.rounds, "new_tokens": args.new_tokens,
            "threads": args.threads, "seconds": time.monotonic() - started, "step_s": raw}


def report(results: dict) -> str:
    rows = []
    for concurrency, by_setting in results["step_s"].items():
        plain = statistics.median(by_setting["plain"])
        for setting in SETTINGS:
            times = sorted(by_setting[setting])
            median = statistics.median(times)
            p90 = times[int(0.9 * (len(times) - 1))]
            rows.append([concurrency, setting, len(times), f"{median * 1000:.2f}",
                         f"{p90 * 1000:.2f}", f"{median / plain:.3f}"])
    return "\n".join([
        report_header("Sampling controls: inter-token latency", "bench/sampling_cost.py", NAME, results),
        (f"{results['rounds']} interleaved rounds of {results['new_tokens']} new tokens per stream, "
         f"{results['threads']} torch thread(s), {results['seconds']:.0f} s in all; the shipped "
         f"model (fp32) in one engine. ITL: one decode-only step (each stream gets a token from it)."),
        "",
        markdown_table(["streams", "setting", "steps", "median ITL (ms)", "p90 ITL (ms)",
                        "median / plain"], rows),
        "",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--render", action="store_true", help="only render the committed results")
    args = parser.parse_args()
    if not args.render:
        save_results(NAME, measure(args))
    write_report(f"{NAME}.md", report(load_results(NAME)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
