"""A prefill chain on a GPU: one NCCL rank against an in-process prefill (GPU run).

Writes docs/benchmarks/runahead-gpu.md: time to first token of the
~50M-parameter random-weight preset in bfloat16 for 1k to 8k-token prompts,
prefilled in this process and by a one-rank chain over NCCL (KV-Runahead and
TSP modes), fastest of --repeats runs each, interleaved. With one GPU the
chain cannot split the work; what it shows is that the NCCL code path runs,
and what the chain's machinery (request broadcast, counters, delivery) costs
on top of the model. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.kv import DenseKV
from baton.model import prefill
from baton.runahead import LocalChain, ModelSource
from common import (
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)

LENGTHS = (1024, 2048, 4096, 8192)


def in_process_ttft(model, token_ids: torch.Tensor) -> float:
    ids = token_ids.cuda()
    torch.cuda.synchronize()
    started = time.perf_counter()
    prefill(model, ids, torch.arange(ids.shape[0], device="cuda"),
            DenseKV(model.config.num_hidden_layers))
    torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(repeats: int) -> dict:
    record = run_record()
    source = ModelSource(preset="random-50m", dtype="bfloat16")
    model = source.load(torch.device("cuda"))
    generator = torch.Generator().manual_seed(0)
    rows = []
    with LocalChain(source, ranks=1, backend="nccl", timeout_s=300) as chain:
        for length in LENGTHS:
            ids = torch.randint(0, model.config.vocab_size, (length,), generator=generator)
            in_process_ttft(model, ids), chain.prefill(ids, return_kv=False)  # warm-up
            best = {"in process": float("inf"), "runahead": float("inf"), "tsp": float("inf")}
            for _ in range(repeats):
                best["in process"] = min(best["in process"], in_process_ttft(model, ids))
                for mode in ("runahead", "tsp"):
                    best[mode] = min(best[mode], chain.prefill(ids, mode=mode, return_kv=False).ttft_s)
            result = chain.prefill(ids)  # with the KV, to check it against the in-process cache
            kv = DenseKV(model.config.num_hidden_layers)
            logits = prefill(model, ids.cuda(), torch.arange(length, device="cuda"), kv).cpu()
            rows.append({"length": length, "ttft_s": best,
                         "max_logit_diff": float((result.first_token_logits - logits).abs().max())})
            print(f"C={length}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.items()),
                  flush=True)
    return {"run": record, "repeats": repeats, "rows": rows}


def render(results: dict) -> str:
    rows = []
    for row in results["rows"]:
        best = row["ttft_s"]
        rows.append([row["length"], *(f"{best[k] * 1e3:.1f}" for k in best),
                     f"{best['runahead'] / best['in process']:.2f}x", f"{row['max_logit_diff']:.1e}"])
    table = markdown_table(["C", "in process (ms)", "chain, KV-Runahead (ms)", "chain, TSP (ms)",
                            "chain / in process", "max |logit diff| chain vs in process"], rows)
    header = report_header("Prefill chain on a GPU (NCCL, one rank)", "bench/runahead_gpu.py",
                           "runahead-gpu", results)
    return f"""{header}
`random-50m`, bfloat16, eager PyTorch; fastest of {results['repeats']} interleaved runs after
a warm-up. The chain's TTFT is taken as the chain reports it: from rank 0 receiving the
request to the tail holding the first token's logits (synchronised). With one GPU a chain
has one rank: the rows time the chain's own machinery over a plain prefill, and the logit
difference compares its first-token logits with this process's prefill of the same prompt.

{table}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--render", action="store_true",
                        help="render the report again from the committed raw results")
    args = parser.parse_args()
    if not args.render:
        if not torch.cuda.is_available():
            print("runahead_gpu.py needs a CUDA device", file=sys.stderr)
            return 2
        save_results("runahead-gpu", measure(args.repeats))
    write_report("runahead-gpu.md", render(load_results("runahead-gpu")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
