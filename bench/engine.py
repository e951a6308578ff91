"""Model runtime speed: baton vs Hugging Face transformers on the same weights.

Writes docs/benchmarks/engine.md: prefill tokens/s at 512 and 2048 tokens,
decode tokens/s at batch 1, 8 and 32, side by side in one run, on the shipped
model and on the ~50M-parameter random-weight preset; and the batch-1 decode
step against the memory-bandwidth bound (bytes read per step / copy bandwidth).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.kv import DenseKV, KVPool
from baton.model import decode_step, load_checkpoint, prefill, save_checkpoint
from baton.model.loader import SHIPPED_MODEL_DIR
from baton.model.presets import random_model
from common import machine_description, markdown_table, median_time, write_report

PREFILL_LENGTHS = (512, 2048)
DECODE_BATCHES = (1, 8, 32)
DECODE_PROMPT = 128
DECODE_STEPS = 16


def copy_bandwidth_bytes_per_s() -> float:
    """Bytes read per second by a large tensor copy (the memory-bandwidth yardstick)."""
    source = torch.empty(64 * 2**20, dtype=torch.float32)  # 256 MiB
    target = torch.empty_like(source)
    seconds = median_time(lambda: target.copy_(source), repeats=5)
    return source.numel() * source.element_size() / seconds


def load_pair(directory: Path):
    import transformers

    ours = load_checkpoint(directory, dtype="float32", device="cpu", with_tokenizer=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return ours, theirs


ROUNDS = 5  # runs per system and row, alternating baton / transformers; the fastest counts


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def ours_prefill(model, length: int):
    ids = torch.randint(0, model.config.vocab_size, (length,))
    layers = model.config.num_hidden_layers
    return lambda: timed(lambda: prefill(model, ids, torch.arange(length), DenseKV(layers)))


def theirs_prefill(model, length: int):
    ids = torch.randint(0, model.config.vocab_size, (1, length))

    def run():
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1)

    return lambda: timed(run)


def ours_decode(model, batch: int):
    """Seconds of DECODE_STEPS steps after a DECODE_PROMPT-token prefill per sequence."""
    config = model.config
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                  block_size=16, num_blocks=batch * config.num_hidden_layers * 16)

    def run() -> float:
        for seq in pool.sequence_ids():
            pool.free(seq)
        kvs = [pool.view(f"s{b}") for b in range(batch)]
        ids = torch.randint(0, config.vocab_size, (DECODE_PROMPT,))
        for kv in kvs:
            prefill(model, ids, torch.arange(DECODE_PROMPT), kv)
        tokens = torch.randint(0, config.vocab_size, (batch,))
        start = time.perf_counter()
        for step in range(DECODE_STEPS):
            positions = torch.full((batch,), DECODE_PROMPT + step)
            tokens = decode_step(model, tokens, positions, kvs).argmax(-1)
        return time.perf_counter() - start

    return run


def theirs_decode(model, batch: int):
    def run() -> float:
        ids = torch.randint(0, model.config.vocab_size, (batch, DECODE_PROMPT))
        with torch.no_grad():
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            tokens = out.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(DECODE_STEPS):
                out = model(tokens, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - start

    return run


def fastest_side_by_side(ours, theirs) -> tuple[float, float]:
    """Fastest seconds of each over ROUNDS alternating runs (after one warm-up each), so
    that load from other processes falls on both alike."""
    ours(), theirs()
    ours_s, theirs_s = [], []
    for _ in range(ROUNDS):
        ours_s.append(ours())
        theirs_s.append(theirs())
    return min(ours_s), min(theirs_s)


def bench_model(label: str, directory: Path, bandwidth: float) -> tuple[list[list], list]:
    ours, theirs = load_pair(directory)
    model = ours.model
    rows = []
    for length in PREFILL_LENGTHS:
        if length > ours.config.max_position_embeddings:
            continue
        a, b = fastest_side_by_side(ours_prefill(model, length), theirs_prefill(theirs, length))
        rows.append([label, f"prefill {length} tokens", f"{length / a:,.0f}", f"{length / b:,.0f}",
                     f"{b / a:.2f}x"])
    step_batch1 = None
    for batch in DECODE_BATCHES:
        a, b = fastest_side_by_side(ours_decode(model, batch), theirs_decode(theirs, batch))
        tokens = batch * DECODE_STEPS
        step_batch1 = a / DECODE_STEPS if batch == 1 else step_batch1
        rows.append([label, f"decode batch {batch}", f"{tokens / a:,.0f}", f"{tokens / b:,.0f}",
                     f"{b / a:.2f}x"])
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = (DECODE_PROMPT + DECODE_STEPS // 2) * ours.config.num_hidden_layers * \
        ours.config.kv_bytes_per_token(4)
    bound = (weight_bytes + kv_bytes) / bandwidth
    bound_row = [label, f"{weight_bytes / 1e6:.0f} MB weights + {kv_bytes / 1e6:.1f} MB KV",
                 f"{bound * 1e3:.2f} ms", f"{step_batch1 * 1e3:.2f} ms", f"{step_batch1 / bound:.2f}x"]
    return rows, bound_row


NOTES = """
## Reading the numbers

* Decode at small batches is where baton gains most: its linear layers compute
  ``(W @ x.T).T`` for at most 4 rows, and for the vocabulary projection up to 64
  (`baton.model.linear`). Written as ``x @ W.T``, MKL runs few rows through
  kernels that stream the weights at a third of copy bandwidth on this CPU.
  Above a few rows both orientations cost the same, and so do baton and
  transformers.
* The bound divides bytes *read* by the bandwidth of a copy, which reads and
  writes every byte. A pure read stream runs faster than that, so a step
  can come in under the bound, as `random-50m`'s does.
* The shipped model is small enough (7.6 M parameters, 4 layers) that a step
  is ~1,100 small tensor operations (views included) whose dispatch costs
  more than reading the 15 MB of weights. Its batch-1 step is bound by per-operation overhead, not
  by memory.
* The KV pool moves data with `index_select` / `index_copy_` (about 10x
  faster than advanced indexing on CPU). Gathering a batch-32 step's KV still
  costs ~5 ms in all, which is about what transformers' `DynamicCache`
  spends on `cat`.
* From batch 8 up, and for prefill, both runtimes spend their time in the same
  MKL matmuls and fused attention kernels, and the ratio is 1.0 give or take
  this machine's noise. Runs of this script an hour apart gave 0.90x and 0.98x
  for random-50m at batch 32, and 0.88x and 0.98x at prefill 2048.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    machine = machine_description()
    bandwidth = copy_bandwidth_bytes_per_s()
    models = []
    if (SHIPPED_MODEL_DIR / "model.safetensors").is_file():
        models.append(("shipped (baton-pystdlib)", SHIPPED_MODEL_DIR))
    scratch = tempfile.TemporaryDirectory()
    random_dir = Path(scratch.name) / "random-50m"
    save_checkpoint(random_model("random-50m"), random_dir, dtype=torch.float32)
    models.append(("random-50m", random_dir))
    speed_rows, bound_rows = [], []
    for label, directory in models:
        print(f"benchmarking {label} ...", flush=True)
        rows, bound_row = bench_model(label, directory, bandwidth)
        speed_rows += rows
        bound_rows.append(bound_row)
    report = f"""# Model runtime: baton vs transformers

Machine: {machine}; {args.threads} threads; fp32. Both runtimes run the same
weights in the same process (`python bench/engine.py`); for every row the two
alternate for {ROUNDS} runs each after a warm-up, and each one's fastest run counts.
Prefill: one prompt. Decode: {DECODE_STEPS} greedy steps after a
{DECODE_PROMPT}-token prompt per sequence (ours: paged KV pool; transformers: its
DynamicCache).

{markdown_table(["model", "work", "baton tokens/s", "transformers tokens/s", "baton / transformers"],
                speed_rows)}

## Batch-1 decode against the memory-bandwidth bound

A decode step at batch 1 must read every weight and the KV cache once.
Measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s (256 MiB tensor copy).
Bound = bytes read per step / copy bandwidth.

{markdown_table(["model", "bytes read per step", "bound", "baton step", "baton / bound"], bound_rows)}
{NOTES}"""
    write_report("engine.md", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
