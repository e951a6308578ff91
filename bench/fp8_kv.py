"""What an fp8 KV cache costs in quality and saves on the wire: bytes shipped per token
(fp8 against bf16 and fp32), greedy agreement and perplexity against the full-precision cache.

One in-process SARATHI engine (the decode pod's) per cache dtype, the model in fp32. Bytes
per token: a chain's push of one token, every layer (keys, values and its 8-byte position;
``baton.transfer.codec``). Greedy agreement: the tokens each prompt's greedy continuation
shares with the full-precision cache's before the first that differs. Perplexity: of a text,
its prompt log-probabilities computed in chunks of ``--chunk`` tokens, so that every chunk
reads the ones before it from the cache. Writes docs/benchmarks/fp8-kv.md from
fp8-kv-results.json.gz.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.config import KVCacheConfig, KVPoolConfig, SchedulerConfig
from baton.model import load_checkpoint
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.presets import random_model
from baton.sampling.params import SamplingParams
from baton.sarathi.engine import Engine
from baton.transfer.codec import kv_header
from common import (
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)

NAME = "fp8-kv"
CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
TEXT = ("The little robot walked to the edge of the garden and looked at the sky. It had "
        "never seen rain before, and it wondered what the clouds were made of. ") * 4


def bytes_per_token(config) -> dict:
    return {name: kv_header((1,) * config.num_hidden_layers, dtype, config.num_key_value_heads,
                            config.head_dim, "r", "m", "v").total_bytes
            for name, dtype in WIRE_DTYPES.items()}


def run(model, prompts: list[list[int]], text: list[int], cache_dtype: str, args) -> dict:
    engine = Engine(model, None, scheduler=SchedulerConfig(token_budget=args.chunk),
                    kv=KVPoolConfig(num_blocks=args.blocks, prefix_cache=False),
                    kv_cache=KVCacheConfig(dtype=cache_dtype))
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    tokens = [result.token_ids for result in engine.generate(prompts, greedy)]
    engine.add_request(text, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    logprobs = []
    while engine.has_unfinished():
        for output in engine.step():
            logprobs += [entry.logprob for entry in output.prompt_logprobs or () if entry is not None]
    return {"tokens": tokens, "nll": -sum(logprobs) / len(logprobs)}


def measure_model(name: str, model, tokenize, args) -> dict:
    prompts = [tokenize(f"{TEXT[start:start + 60]}") for start in range(0, 240, 60)]
    text = tokenize(TEXT)[:args.text_tokens]
    runs = {dtype: run(model, prompts, text, dtype, args) for dtype in CACHE_DTYPES}
    return {"name": name, "bytes_per_token": bytes_per_token(model.config), "runs": runs}


def measure(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    torch.set_num_threads(args.threads)
    shipped = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cpu")
    models = [measure_model("shipped", shipped.model, shipped.tokenizer.encode, args)]
    random = random_model(args.random_preset).eval()
    vocab = random.config.vocab_size
    models.append(measure_model(args.random_preset, random,
                                lambda s: [hash(w) % vocab for w in s.split()] * 3, args))
    return {"run": run_record(), "threads": args.threads, "chunk": args.chunk,
            "new_tokens": args.new_tokens, "seconds": time.monotonic() - started, "models": models}


def agreement(full: list[list[int]], other: list[list[int]]) -> float:
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(full, other)]
    return sum(agreed) / sum(len(x) for x in full)


def report(results: dict) -> str:
    rows, wire = [], []
    for entry in results["models"]:
        runs = entry["runs"]
        for dtype in CACHE_DTYPES:
            rows.append([entry["name"], dtype, f"{agreement(runs['auto']['tokens'], runs[dtype]['tokens']):.3f}",
                         f"{math.exp(runs[dtype]['nll']):.4f}"])
        sizes = entry["bytes_per_token"]
        wire.append([entry["name"], *(sizes[name] for name in WIRE_DTYPES),
                     f"{sizes['fp8'] / sizes['bf16']:.3f}"])
    return "\n".join([
        report_header("FP8 KV cache: bytes shipped, agreement, perplexity", "bench/fp8_kv.py",
                      NAME, results),
        (f"The model in fp32, {results['threads']} torch thread(s), chunks of {results['chunk']} "
         f"tokens, {results['new_tokens']} greedy tokens per prompt, {results['seconds']:.0f} s in "
         "all. auto = the full-precision (fp32) cache; fp8 scale 1.0 (uncalibrated). The "
         "random model's text is random token ids: its perplexity is near its vocabulary's, and "
         "only the difference between rows means anything."),
        "",
        "Bytes a chain ships per token, all layers (keys, values, position):",
        "",
        markdown_table(["model", *WIRE_DTYPES, "fp8 / bf16"], wire),
        "",
        "Against the full-precision cache (agreement: greedy tokens before the first that differs):",
        "",
        markdown_table(["model", "kv cache", "greedy agreement", "perplexity"], rows),
        "",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--text-tokens", type=int, default=160)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--random-preset", default="random-100m")
    parser.add_argument("--render", action="store_true", help="only render the committed results")
    args = parser.parse_args()
    if not args.render:
        save_results(NAME, measure(args))
    write_report(f"{NAME}.md", report(load_results(NAME)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
