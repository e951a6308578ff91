"""Serving: the local cluster against transformers and baton's monolithic engine, same requests.

Writes docs/benchmarks/serve.md and serve.png (from serve-results.json.gz). For each model
(the shipped one and the ~50M-parameter random-weight preset) one workload of mixed requests — mostly short
prompts, a quarter long enough for the prefill chain, output lengths spread — runs three
ways, side by side in one run:

* transformers: ``model.generate`` greedily, one request after another (what a user reaches
  for first), on the same weights;
* baton's monolithic engine: every request handed to one in-process SARATHI engine;
* the baton cluster: ``LocalCluster`` processes (gateway, a 2-rank KV-Runahead chain, one
  decode pod, a private redis-server), the requests sent by concurrent gRPC clients.

Every request arrives at t = 0 (a burst), so TTFT includes queueing; throughput is generated
tokens over the time to the last token; time between tokens (TBT) is every gap between a
request's consecutive tokens. Greedy everywhere, stopping at EOS or max_tokens.
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.api.requests import CompressionParams, GenerateRequest
from baton.client import BatonClient, Completion
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from baton.model import load_checkpoint, save_checkpoint
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.presets import random_model
from baton.sampling.params import SamplingParams
from baton.sarathi.engine import Engine
from common import (
    REPORT_DIR,
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)

CHAIN_THRESHOLD_TOKENS = 512
SHORT_PROMPT_TOKENS = (16, 128)
LONG_PROMPT_TOKENS = (CHAIN_THRESHOLD_TOKENS, 900)  # the shipped model's context is 1024
OUTPUT_TOKENS = (8, 48)
LONG_FRACTION = 0.25
THREADS = 1  # per process: two-thread OpenMP collapses on a shared, oversubscribed machine


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class Trace:
    """When each token of one request arrived (seconds after the burst started)."""

    token_times_s: list[float] = field(default_factory=list)
    path: str = ""


def make_workload(tokenizer, num_requests: int, seed: int) -> list[Request]:
    """Mixed prompts cut from real Python source; ids fit every model's vocabulary."""
    import email.message
    import json.decoder

    source = tokenizer.encode(inspect.getsource(json.decoder) + inspect.getsource(email.message))
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        bounds = LONG_PROMPT_TOKENS if rng.random() < LONG_FRACTION else SHORT_PROMPT_TOKENS
        length = rng.randint(*bounds)
        start = rng.randint(0, len(source) - length)
        requests.append(Request(source[start:start + length], rng.randint(*OUTPUT_TOKENS)))
    return requests


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


# --- the three systems -------------------------------------------------------------------------


def run_transformers(directory: Path, requests: list[Request]) -> list[Trace]:
    import transformers
    from transformers.generation.streamers import BaseStreamer

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id

    class TokenClock(BaseStreamer):
        def __init__(self, trace: Trace, start_s: float) -> None:
            self.trace, self.start_s, self.prompt_seen = trace, start_s, False

        def put(self, value) -> None:
            if not self.prompt_seen:  # generate() hands the prompt over first
                self.prompt_seen = True
                return
            self.trace.token_times_s.extend([time.perf_counter() - self.start_s] * value.numel())

        def end(self) -> None:
            pass

    traces = [Trace(path="sequential") for _ in requests]
    start_s = time.perf_counter()
    with torch.inference_mode():
        for request, trace in zip(requests, traces):
            model.generate(torch.tensor([request.prompt_ids]), max_new_tokens=request.max_tokens,
                           do_sample=False, eos_token_id=eos, pad_token_id=eos or 0,
                           streamer=TokenClock(trace, start_s))
    return traces


def run_engine(directory: Path, requests: list[Request]) -> list[Trace]:
    loaded = load_checkpoint(directory, dtype="float32", device="cpu")
    engine = Engine(loaded.model, loaded.tokenizer)
    start_s = time.perf_counter()
    ids = [engine.add_request(r.prompt_ids, greedy(r.max_tokens)) for r in requests]
    traces = {request_id: Trace(path="in-process") for request_id in ids}
    pending = set(ids)
    while pending:
        for output in engine.step():
            now_s = time.perf_counter() - start_s
            traces[output.request_id].token_times_s.extend([now_s] * len(output.new_token_ids))
            if output.finished:
                pending.discard(output.request_id)
    return [traces[request_id] for request_id in ids]


def run_cluster(directory: Path, requests: list[Request]) -> list[Trace]:
    # the same dtype as the other two (the pods' default, auto, may pick bf16)
    os.environ["BATON_MODEL_DTYPE"] = "float32"
    spec = ClusterSpec(model_path=str(directory), decode_workers=1, chain_ranks=2,
                       prefill_threshold_tokens=CHAIN_THRESHOLD_TOKENS, chain_break_even=False,
                       threads_per_process=1, decode_threads=1)
    traces = [Trace() for _ in requests]
    with LocalCluster(spec) as cluster:
        warm = BatonClient(cluster.gateway_address)
        warm.wait_until_serving(60)
        for prompt_ids in ([1, 2, 3], list(range(1, CHAIN_THRESHOLD_TOKENS + 1))):  # one of each path
            warm.generate(GenerateRequest(token_ids=tuple(prompt_ids), sampling=greedy(2)))
        warm.close()
        start_s = time.perf_counter()

        def send(index: int) -> None:
            request, trace = requests[index], traces[index]
            client = BatonClient(cluster.gateway_address)
            completion = Completion()
            try:
                for step in client.stream(GenerateRequest(
                        token_ids=tuple(request.prompt_ids), sampling=greedy(request.max_tokens),
                        compression=CompressionParams(enabled=False))):
                    now_s = time.perf_counter() - start_s
                    trace.token_times_s.extend([now_s] * len(step.token_ids))
                    completion.add(step, now_s, 0.0)
            finally:
                client.close()
            trace.path = "chain" if completion.last.route.chain_id else "local"

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return traces


# --- figures -------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(traces: list[Trace], seconds: float) -> dict[str, float]:
    ttft = [trace.token_times_s[0] for trace in traces if trace.token_times_s]
    gaps = [b - a for trace in traces for a, b in zip(trace.token_times_s, trace.token_times_s[1:])]
    tokens = sum(len(trace.token_times_s) for trace in traces)
    return {"tokens": tokens, "seconds": seconds, "throughput": tokens / seconds,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tbt_p50": percentile(gaps, 50), "tbt_p99": percentile(gaps, 99)}


def bench_model(label: str, directory: Path, requests: list[Request]) -> dict[str, dict]:
    results = {}
    for system, run in (("transformers", run_transformers), ("baton engine", run_engine),
                        ("baton cluster", run_cluster)):
        torch.set_num_threads(THREADS)
        print(f"[{label}] {system}: {len(requests)} requests ...", flush=True)
        traces = run(directory, requests)
        seconds = max(trace.token_times_s[-1] for trace in traces if trace.token_times_s)
        results[system] = summarize(traces, seconds)
        if system == "baton cluster":
            results[system]["chain_requests"] = sum(trace.path == "chain" for trace in traces)
        print(f"[{label}] {system}: {results[system]}", flush=True)
    return results


def plot(all_results: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("throughput", "generated tokens/s", [("throughput", "")]),
              ("TTFT", "seconds", [("ttft_p50", "P50"), ("ttft_p99", "P99")]),
              ("time between tokens", "milliseconds", [("tbt_p50", "P50"), ("tbt_p99", "P99")])]
    figure, axes = plt.subplots(len(all_results), 3, figsize=(13, 3.6 * len(all_results)), squeeze=False)
    for row, (label, results) in enumerate(all_results.items()):
        systems = list(results)
        for column, (title, unit, keys) in enumerate(panels):
            axis = axes[row][column]
            width = 0.8 / len(keys)
            for k, (key, name) in enumerate(keys):
                scale = 1000 if unit == "milliseconds" else 1
                values = [results[s][key] * scale for s in systems]
                positions = [i + k * width for i in range(len(systems))]
                axis.bar(positions, values, width, label=name or None)
            axis.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(systems))], systems)
            axis.set_title(f"{label.split(' (')[0]}: {title}")
            axis.set_ylabel(unit)
            if len(keys) > 1:
                axis.legend()
            if unit == "milliseconds":  # baton's batched steps and single-sequence steps differ ~50x
                axis.set_yscale("log")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def report(raw: dict) -> str:
    all_results, num_requests = raw["models"], raw["num_requests"]
    sections, comparisons = [], []
    for label, results in all_results.items():
        cluster, engine, theirs = (results[name] for name in ("baton cluster", "baton engine",
                                                              "transformers"))
        comparisons.append(
            f"* {label}: the cluster's throughput is {cluster['throughput'] / engine['throughput']:.2f}x "
            f"the monolithic engine's and {cluster['throughput'] / theirs['throughput']:.2f}x "
            f"transformers'; its TTFT P50 is {cluster['ttft_p50']:.2f} s against "
            f"{engine['ttft_p50']:.2f} s and {theirs['ttft_p50']:.2f} s.")
        rows = [[system, r["tokens"], f"{r['seconds']:.1f}", f"{r['throughput']:.1f}",
                 f"{r['ttft_p50']:.2f}", f"{r['ttft_p99']:.2f}",
                 f"{r['tbt_p50'] * 1000:.1f}", f"{r['tbt_p99'] * 1000:.1f}"]
                for system, r in results.items()]
        table = markdown_table(["system", "tokens", "time (s)", "tokens/s", "TTFT P50 (s)",
                                "TTFT P99 (s)", "TBT P50 (ms)", "TBT P99 (ms)"], rows)
        chain = results["baton cluster"].get("chain_requests", 0)
        sections.append(f"### {label}\n\n{table}\n\nThe cluster sent {chain} of {num_requests} "
                        f"requests through the chain.\n")
    plot(all_results, REPORT_DIR / "serve.png")
    return "\n".join([
        report_header("Serving: baton's cluster vs transformers vs the monolithic engine",
                      "bench/serve.py", "serve", raw),
        f"Whole run: {raw['elapsed_s'] / 60:.1f} min.", "",
        f"Workload: {raw['workload']}", "",
        *sections,
        "![serving](serve.png)", "",
        "## Summary", "",
        *comparisons,
        ("* transformers runs the requests one after another, as `model.generate` does; the "
         "monolithic engine batches every request in one process on one thread; the cluster "
         "runs gateway, two chain ranks and one decode pod as processes with one thread each."),
        ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", default="shipped,random-50m")
    parser.add_argument("--render", action="store_true",
                        help="render the report again from the committed raw results")
    args = parser.parse_args()
    if not args.render:
        save_results("serve", measure(args))
    write_report("serve.md", report(load_results("serve")))
    return 0


def measure(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    record = run_record()
    tokenizer = load_checkpoint(SHIPPED_MODEL_DIR, with_tokenizer=True).tokenizer
    requests = make_workload(tokenizer, args.requests, args.seed)
    num_long = sum(len(r.prompt_ids) >= CHAIN_THRESHOLD_TOKENS for r in requests)
    workload_note = (f"{len(requests)} requests arriving together; {num_long} long prompts "
                     f"({LONG_PROMPT_TOKENS[0]}-{LONG_PROMPT_TOKENS[1]} tokens, through the chain in "
                     f"the cluster), the rest {SHORT_PROMPT_TOKENS[0]}-{SHORT_PROMPT_TOKENS[1]} "
                     f"tokens; {OUTPUT_TOKENS[0]}-{OUTPUT_TOKENS[1]} output tokens each (greedy, "
                     f"EOS stops); compression off; float32 in all three; seed {args.seed}.")
    all_results = {}
    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            if name == "shipped":
                directory, label = SHIPPED_MODEL_DIR, "shipped model (baton-pystdlib)"
            else:
                directory, label = Path(work) / name, f"{name} (random weights)"
                save_checkpoint(random_model(name), directory, dtype=torch.float32)
                shutil.copy(SHIPPED_MODEL_DIR / "tokenizer.json", directory / "tokenizer.json")
            all_results[label] = bench_model(label, directory, requests)
    return {"run": record, "num_requests": len(requests), "workload": workload_note,
            "models": all_results, "elapsed_s": time.perf_counter() - started}


if __name__ == "__main__":
    sys.exit(main())
