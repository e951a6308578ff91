"""Model runtime speed: baton vs Hugging Face transformers on the same weights.

Writes docs/benchmarks/engine.md (from engine-results.json.gz beside it): prefill tokens/s at 512 and 2048 tokens,
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
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.presets import random_model
from common import (
    load_results,
    markdown_table,
    median_time,
    report_header,
    run_record,
    save_results,
    write_report,
)

PREFILL_LENGTHS = (512, 2048)
DECODE_BATCHES = (1, 8, 32)
DECODE_PROMPT = 128
DECODE_STEPS = 16


DEVICE = torch.device("cpu")  # set by --device; CUDA runs both runtimes in bfloat16
DTYPE = torch.float32


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth_bytes_per_s() -> float:
    """Bytes read per second by a large tensor copy (the memory-bandwidth yardstick)."""
    source = torch.empty(256 * 2**20 if DEVICE.type == "cuda" else 64 * 2**20,
                         dtype=torch.float32, device=DEVICE)  # 1 GiB on a GPU, 256 MiB on CPU

    def copy() -> None:
        target.copy_(source)
        synchronize()

    target = torch.empty_like(source)
    seconds = median_time(copy, repeats=5)
    return source.numel() * source.element_size() / seconds


def load_pair(directory: Path):
    import transformers

    dtype_name = str(DTYPE).removeprefix("torch.")
    ours = load_checkpoint(directory, dtype=dtype_name, device=DEVICE.type, with_tokenizer=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPE)
    return ours, theirs.to(DEVICE).eval()


ROUNDS = 5  # runs per system and row, alternating baton / transformers; the fastest counts


def timed(fn) -> float:
    synchronize()
    started = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - started


def ours_prefill(model, length: int):
    ids = torch.randint(0, model.config.vocab_size, (length,), device=DEVICE)
    layers = model.config.num_hidden_layers
    positions = torch.arange(length, device=DEVICE)
    return lambda: timed(lambda: prefill(model, ids, positions, DenseKV(layers)))


def theirs_prefill(model, length: int):
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=DEVICE)

    def run():
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1)

    return lambda: timed(run)


def ours_decode(model, batch: int):
    """Seconds of DECODE_STEPS steps after a DECODE_PROMPT-token prefill per sequence."""
    config = model.config
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                  block_size=16, num_blocks=batch * config.num_hidden_layers * 16,
                  dtype=DTYPE, device=DEVICE)

    def run() -> float:
        for seq in pool.sequence_ids():
            pool.free(seq)
        kvs = [pool.view(f"s{b}") for b in range(batch)]
        ids = torch.randint(0, config.vocab_size, (DECODE_PROMPT,), device=DEVICE)
        for kv in kvs:
            prefill(model, ids, torch.arange(DECODE_PROMPT, device=DEVICE), kv)
        tokens = torch.randint(0, config.vocab_size, (batch,), device=DEVICE)
        synchronize()
        start = time.perf_counter()
        for step in range(DECODE_STEPS):
            positions = torch.full((batch,), DECODE_PROMPT + step, device=DEVICE)
            tokens = decode_step(model, tokens, positions, kvs).argmax(-1)
        synchronize()
        return time.perf_counter() - start

    return run


def theirs_decode(model, batch: int):
    def run() -> float:
        ids = torch.randint(0, model.config.vocab_size, (batch, DECODE_PROMPT), device=DEVICE)
        with torch.no_grad():
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            tokens = out.logits[:, -1].argmax(-1, keepdim=True)
            synchronize()
            start = time.perf_counter()
            for _ in range(DECODE_STEPS):
                out = model(tokens, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        synchronize()
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
        ours.config.kv_bytes_per_token(torch.finfo(DTYPE).bits // 8)
    bound = (weight_bytes + kv_bytes) / bandwidth
    bound_row = [label, f"{weight_bytes / 1e6:.0f} MB weights + {kv_bytes / 1e6:.1f} MB KV",
                 f"{bound * 1e3:.2f} ms", f"{step_batch1 * 1e3:.2f} ms", f"{step_batch1 / bound:.2f}x"]
    return rows, bound_row



def measure(args: argparse.Namespace) -> dict:
    global DEVICE, DTYPE
    DEVICE = torch.device(args.device)
    DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    record = run_record()
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
    return {"run": record, "device": DEVICE.type, "threads": args.threads,
            "copy_bandwidth_bytes_per_s": bandwidth, "speed_rows": speed_rows,
            "bound_rows": bound_rows}


def render(results: dict, name: str) -> str:
    on_gpu = results["device"] == "cuda"
    title = "Model runtime on a GPU" if on_gpu else "Model runtime"
    precision = "GPU run, bfloat16" if on_gpu else f"{results['threads']} threads; fp32"
    bandwidth = results["copy_bandwidth_bytes_per_s"]
    bandwidth_source = "1 GiB device-to-device copy" if on_gpu else "256 MiB tensor copy"
    header = report_header(f"{title}: baton vs transformers", "bench/engine.py", name, results)
    return f"""{header}
{precision}. Both runtimes run the same weights in the same process; for every row the
two alternate for {ROUNDS} runs each after a warm-up, and each one's fastest run counts.
Prefill: one prompt. Decode: {DECODE_STEPS} greedy steps after a
{DECODE_PROMPT}-token prompt per sequence (ours: paged KV pool; transformers: its
DynamicCache).

{markdown_table(["model", "work", "baton tokens/s", "transformers tokens/s", "baton / transformers"],
                results["speed_rows"])}

## Batch-1 decode against the memory-bandwidth bound

A decode step at batch 1 must read every weight and the KV cache once.
Measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s ({bandwidth_source}).
Bound = bytes read per step / copy bandwidth (a copy reads and writes every byte, so a
step that only reads can come in under it).

{markdown_table(["model", "bytes read per step", "bound", "baton step", "baton / bound"],
                results["bound_rows"])}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: both runtimes in bfloat16 on the GPU; writes engine-gpu.md")
    parser.add_argument("--render", action="store_true",
                        help="render the report again from the committed raw results")
    args = parser.parse_args()
    name = "engine-gpu" if args.device == "cuda" else "engine"
    if not args.render:
        save_results(name, measure(args))
    write_report(f"{name}.md", render(load_results(name), name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
