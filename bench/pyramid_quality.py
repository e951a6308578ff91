"""PyramidInfer quality and cost: compressed vs full KV cache on held-out text.

Writes docs/benchmarks/pyramid.md and PNG plots beside it:

* teacher-forced perplexity of the 64 tokens after each prompt (512-1024
  tokens of the held-out split of the shipped model's corpus) and greedy
  next-token agreement with the full cache, at total KV budgets of 30-80%,
  for PyramidInfer, "local" (sinks + most recent, StreamingLLM) and a uniform
  per-layer budget with the same selector;
* KV length per layer (the pyramid) and KV bytes per request;
* the time the selection adds to a 2k-token prefill (on the ~50M random
  preset when the model's context is shorter than 2k).

Every continuation token is predicted from the compressed prompt cache: the
64 continuation tokens are fed as one chunk over it (the 65th token is the
last target), so the last prompt logits, which come before compression,
never count.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.config import PyramidConfig
from baton.kv import DenseKV, LayerKV
from baton.model import CausalLM, Segment, load_checkpoint, prefill
from baton.model.presets import random_model
from baton.pyramid import compressor_factory, layer_budgets
from common import (
    REPORT_DIR,
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)

BUDGETS = (0.3, 0.45, 0.5, 0.6, 0.8)
POLICIES = ("pyramid", "uniform", "local")
CONTINUATION = 64
PROMPT_LENGTHS = (512, 768, 1024)
TIMING_LENGTH = 2048


def held_out_samples(tokenizer, num_samples: int, max_context: int) -> list[torch.Tensor]:
    """Prompt + continuation windows cut from the held-out split, lengths cycling 512/768/1024."""
    from baton.train.corpus import held_out_text

    ids = torch.tensor(tokenizer.encode(held_out_text()), dtype=torch.int64)
    samples, offset = [], 0
    for index in range(num_samples):
        prompt_length = min(PROMPT_LENGTHS[index % len(PROMPT_LENGTHS)],
                            max_context - CONTINUATION - 1)
        end = offset + prompt_length + CONTINUATION + 1
        if end > ids.numel():
            break
        samples.append(ids[offset:end])
        offset = end
    return samples


def random_samples(vocab_size: int, num_samples: int, max_context: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (min(PROMPT_LENGTHS[i % 3], max_context - CONTINUATION - 1)
                                          + CONTINUATION + 1,), generator=generator)
            for i in range(num_samples)]


class FanOut:
    """One prefill feeds several compressors (one per policy and budget)."""

    def __init__(self, observers) -> None:
        self.observers = observers

    def observe(self, *args) -> None:
        for observer in self.observers:
            observer.observe(*args)


def continuation_logits(model: CausalLM, layers: list[LayerKV], tokens: torch.Tensor,
                        start: int) -> torch.Tensor:
    """Teacher-forced logits [T, vocab] of ``tokens`` fed as one chunk after the cache."""
    kv = DenseKV(len(layers), list(layers))
    positions = torch.arange(start, start + tokens.numel())
    rows = torch.arange(tokens.numel())
    return model.logits(model(tokens, positions, [Segment(tokens.numel(), kv)], rows))


def evaluate(model: CausalLM, samples: list[torch.Tensor]) -> dict:
    """Summed NLL, agreement counts and KV tokens per (policy, budget), plus the full cache's."""
    make = {(policy, budget): compressor_factory(PyramidConfig(keep_ratio=budget, policy=policy),
                                                 model.config)
            for policy in POLICIES for budget in BUDGETS}
    results = {key: {"nll": 0.0, "agree": 0, "kv_tokens": 0} for key in make}
    full = {"nll": 0.0, "agree": 0, "kv_tokens": 0, "count": 0}
    for sample in samples:
        prompt_length = sample.numel() - CONTINUATION - 1
        prompt, feed = sample[:prompt_length], sample[prompt_length:-1]
        targets = sample[prompt_length + 1:]
        compressors = {key: factory(prompt_length) for key, factory in make.items()}
        kv = DenseKV(model.config.num_hidden_layers)
        prefill(model, prompt, torch.arange(prompt_length), kv,
                observer=FanOut(list(compressors.values())), want_logits=False)
        layers = kv.complete_layers()
        full_logits = continuation_logits(model, layers, feed, prompt_length)
        full_choice = full_logits.argmax(-1)
        full["nll"] += float(torch.nn.functional.cross_entropy(full_logits, targets, reduction="sum"))
        full["kv_tokens"] += sum(layer.num_tokens for layer in layers)
        full["count"] += targets.numel()
        for key, compressor in compressors.items():
            kept = compressor.compress(layers)
            logits = continuation_logits(model, kept, feed, prompt_length)
            results[key]["nll"] += float(torch.nn.functional.cross_entropy(logits, targets,
                                                                           reduction="sum"))
            results[key]["agree"] += int((logits.argmax(-1) == full_choice).sum())
            results[key]["kv_tokens"] += sum(layer.num_tokens for layer in kept)
        print(f"sample of {prompt_length} tokens done", flush=True)
    return {"full": full, "compressed": results}


def selection_overhead(model: CausalLM, length: int, repeats: int = 3) -> tuple[float, float]:
    """Median seconds of a plain prefill and of one with scoring + compression (interleaved)."""
    ids = torch.randint(0, model.config.vocab_size, (length,),
                        generator=torch.Generator().manual_seed(1))
    positions = torch.arange(length)
    make = compressor_factory(PyramidConfig(), model.config)

    def plain() -> None:
        prefill(model, ids, positions, DenseKV(model.config.num_hidden_layers))

    def compressed() -> None:
        compressor = make(length)
        kv = DenseKV(model.config.num_hidden_layers)
        prefill(model, ids, positions, kv, observer=compressor)
        compressor.compress(kv.complete_layers())

    plain(), compressed()  # warm up
    plain_times, compressed_times = [], []
    for _ in range(repeats):
        for fn, times in ((plain, plain_times), (compressed, compressed_times)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return sorted(plain_times)[repeats // 2], sorted(compressed_times)[repeats // 2]


def plot(path: Path, title: str, ylabel: str, series: dict[str, list[float]],
         full_value: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for name, values in series.items():
        axes.plot([100 * b for b in BUDGETS], values, marker="o", label=name)
    if full_value is not None:
        axes.axhline(full_value, color="black", linestyle="--", label="full cache")
    axes.set_xlabel("KV budget (% of the full cache)")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_layers(path: Path, num_layers: int, prompt_length: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    layers = range(num_layers)
    for budget in BUDGETS:
        counts = layer_budgets(PyramidConfig(keep_ratio=budget), len(layers), prompt_length)
        axes.plot(layers, counts, marker="o", label=f"pyramid {budget:.0%}")
    uniform = layer_budgets(PyramidConfig(keep_ratio=0.5, policy="uniform"), len(layers),
                            prompt_length)
    axes.plot(layers, uniform, linestyle="--", color="gray", label="uniform 50%")
    axes.set_xlabel("layer")
    axes.set_ylabel(f"KV tokens kept (prompt of {prompt_length})")
    axes.set_title("KV length per layer")
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def report(results: dict) -> str:
    full = results["full"]
    count = full["count"]
    full_ppl = math.exp(full["nll"] / count)
    bytes_per_token = results["kv_bytes_per_token"]
    num_samples = len(results["sample_tokens"])
    rows, ppl_series, agree_series = [], {p: [] for p in POLICIES}, {p: [] for p in POLICIES}
    for budget in BUDGETS:
        for policy in POLICIES:
            result = results["compressed"][f"{policy} {budget}"]
            ppl = math.exp(result["nll"] / count)
            agree = result["agree"] / count
            kept = result["kv_tokens"] / full["kv_tokens"]
            ppl_series[policy].append(ppl)
            agree_series[policy].append(agree)
            rows.append([f"{budget:.0%}", policy, f"{kept:.1%}", f"{ppl:.3f}",
                         f"{100 * (ppl / full_ppl - 1):+.2f}%", f"{agree:.1%}",
                         f"{result['kv_tokens'] / num_samples * bytes_per_token / 2**20:.2f}"])
    plot(REPORT_DIR / "pyramid_perplexity.png", "Perplexity of the next 64 tokens", "perplexity",
         ppl_series, full_ppl)
    plot(REPORT_DIR / "pyramid_agreement.png", "Greedy next-token agreement with the full cache",
         "agreement", agree_series)
    prompt_length = max(results["sample_tokens"]) - CONTINUATION - 1
    plot_layers(REPORT_DIR / "pyramid_layers.png", results["layers"], prompt_length)
    plain_s, compressed_s = results["timing_s"]
    timing_model = results["timing_model"]
    wins = [budget for index, budget in enumerate(BUDGETS)
            if ppl_series["pyramid"][index] < min(ppl_series["uniform"][index],
                                                  ppl_series["local"][index])]
    half = BUDGETS.index(0.5)
    half_gap = 100 * (ppl_series["pyramid"][half] / full_ppl - 1)
    lengths = sorted({n - CONTINUATION - 1 for n in results["sample_tokens"]})
    header = report_header("PyramidInfer: quality and cost of KV compression",
                           "bench/pyramid_quality.py", "pyramid", results)
    return f"""{header}
* Model: **{results['model']}** ({results['layers']} layers,
  {results['heads']} query / {results['kv_heads']} KV heads, fp32).
* Text: {num_samples} windows of the held-out split (`baton.train.corpus`), prompts of
  {', '.join(map(str, lengths))} tokens, {CONTINUATION} continuation tokens each
  ({count} predictions per configuration).

Every continuation token is predicted from the compressed prompt cache (teacher forcing: the 64
tokens are fed as one chunk over it). Agreement = the compressed cache's greedy choice equals the
full cache's at the same step. Policies at the same total budget: **pyramid** (per-layer budgets
falling with depth, tokens chosen by recent-query attention), **uniform** (same budget in every
layer, same selector), **local** (sinks + most recent tokens, StreamingLLM). Every policy always
keeps the 4 sinks and the recent window (last 20% of the prompt), so no budget goes below ~21%.

## Results

Full cache: perplexity **{full_ppl:.3f}**, {full['kv_tokens'] / num_samples * bytes_per_token / 2**20:.2f} MiB of KV per request (fp32).

{markdown_table(["budget", "policy", "KV kept", "perplexity", "vs full", "agreement",
                 "KV MiB / request"], rows)}

* At the 50% budget PyramidInfer's perplexity is {half_gap:+.2f}% from the full cache's
  (goal: within 3%): **{"met" if abs(half_gap) <= 3 else "not met"}**.
* PyramidInfer has the lowest perplexity of the three at the budgets
  {', '.join(f'{b:.0%}' for b in wins) or 'none'} (goal: all of {', '.join(f'{b:.0%}' for b in BUDGETS)}):
  **{"met" if len(wins) == len(BUDGETS) else "not met"}**.

![perplexity](pyramid_perplexity.png)
![agreement](pyramid_agreement.png)

## The pyramid

KV tokens kept per layer for a prompt of {prompt_length} tokens (pyramid budgets at each total
budget; the uniform baseline at 50% for comparison). KV bytes per request are in the table above.

![layers](pyramid_layers.png)

## Time the selection adds to a prefill

{TIMING_LENGTH}-token prefill on {timing_model} (median of 3, interleaved): plain
{plain_s:.3f} s, with scoring as each layer is computed and the final selection
{compressed_s:.3f} s: **{100 * (compressed_s / plain_s - 1):+.1f}%** (goal: under 5%).
"""


def measure(args: argparse.Namespace) -> dict:
    record = run_record()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model == "random-50m":
        model = random_model("random-50m")
        model_name = "random-50m (random weights, random tokens: a smoke run, not a quality figure)"
        samples = random_samples(model.config.vocab_size, args.samples,
                                 model.config.max_position_embeddings)
    else:
        loaded = load_checkpoint(args.model, dtype="float32", device="cpu")
        model, model_name = loaded.model, loaded.model_id
        samples = held_out_samples(loaded.tokenizer, args.samples,
                                   loaded.config.max_position_embeddings)
    quality = evaluate(model, samples)
    if model.config.max_position_embeddings >= TIMING_LENGTH and model.config.num_parameters() > 2e7:
        timing_model, timed = model_name, model
    else:
        timing_model, timed = "the ~50M random preset (random-50m)", random_model("random-50m")
    config = model.config
    return {"run": record, "model": model_name, "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
            "kv_bytes_per_token": config.kv_bytes_per_token(4),
            "sample_tokens": [sample.numel() for sample in samples], "full": quality["full"],
            "compressed": {f"{policy} {budget}": result
                           for (policy, budget), result in quality["compressed"].items()},
            "timing_s": list(selection_overhead(timed, TIMING_LENGTH)), "timing_model": timing_model}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="",
                        help="checkpoint directory (default: the shipped model); "
                             "'random-50m' = random weights on random tokens (a smoke run)")
    parser.add_argument("--samples", type=int, default=9, help="held-out windows to evaluate")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--render", action="store_true",
                        help="render the report again from the committed raw results")
    args = parser.parse_args()
    if not args.render:
        save_results("pyramid", measure(args))
    write_report("pyramid.md", report(load_results("pyramid")))


if __name__ == "__main__":
    main()
