"""Where disaggregation pays: a prompt's time to first token on each route, predicted from
measured rates, checked against `baton up`, and projected to a GPU cluster.

One question: from which prompt length does a prefill chain (and a remote prefill) beat
prefilling on the decode pod? The model:

    TTFT_local(L) = hop_local + prefill_1(L)
    TTFT_chain(L) = hop_chain + prefill_chain(L) + kv_bytes(L) / bandwidth

(``baton.runahead.break_even``: the rule a chain advertises its break-even by, which the
gateway routes on; this script predicts with its functions.)

* prefill_1: the decode pod's own prefill of L tokens (one process, the decode pod's
  threads); prefill_chain: a chain's (``LocalChain``, 2 ranks of 1 thread, the shipped
  partition table), both measured here on the shipped model (``--measure``);
* kv_bytes(L): what PushKV carries, L x layers x (2 x kv heads x head dim x dtype bytes
  + 8 position bytes), times the kept fraction (1 here: the served runs turn compression
  off);
* bandwidth: gRPC PushKV end to end into a decode pod's receiver in a process of its own,
  as a tail and a pod run (docs/benchmarks/kv-transfer-results.json.gz);
* hop_local, hop_chain: the fixed cost of a request on each route (gateway, gRPC calls,
  the first step), fitted at the shortest served length; every other length is predicted.

The served TTFTs are `bench/route_ttft.py`'s (docs/benchmarks/route-ttft-results.json.gz,
this tree's rounds). The GPU projection uses the same equations with the inputs its table
names (datasheet figures and stated assumptions, not measurements).

    .venv/bin/python bench/pd_model.py --measure
    .venv/bin/python bench/pd_model.py --render

Writes docs/benchmarks/pd-model.md from docs/benchmarks/pd-model-results.json.gz.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.runahead.break_even import Link, chain_ttft_s, kv_bytes_per_token
from common import (
    load_results,
    markdown_table,
    recorded_run,
    report_header,
    run_record,
    save_results,
    write_report,
)
from kv_transfer import OWN_GRPC, OWN_TCP  # the rows a tail and a pod see: each its own process

LENGTHS = (128, 256, 384, 512, 640, 768, 896, 1024)
RANKS = 2
GOAL_ERROR = 0.20  # predicted within 20% of measured


def measure(repeats: int) -> dict:
    import torch
    from baton.model.hub import SHIPPED_MODEL_DIR
    from baton.model.loader import resolve_dtype
    from baton.runahead import LocalChain, ModelSource, PartitionTable
    from baton.runahead.tuner import single_process_ttft

    # the precision `baton up`'s pods resolve `auto` to here (bf16 where the CPU multiplies
    # it in hardware): the served runs this model is checked against ran in it
    dtype = resolve_dtype("auto", torch.device("cpu"))
    source = ModelSource(path=str(SHIPPED_MODEL_DIR), dtype=str(dtype).removeprefix("torch."))
    model = source.load(torch.device("cpu"))
    config = model.config
    table = PartitionTable.load()
    threads = torch.get_num_threads()  # a lone decode pod of `baton up` takes every core
    generator = torch.Generator().manual_seed(0)
    local: dict[int, float] = {}
    chain: dict[int, float] = {}
    with LocalChain(source, RANKS, table=table, timeout_s=300) as runner:
        for length in LENGTHS:
            ids = torch.randint(0, config.vocab_size, (length,), generator=generator)
            boundaries = table.boundaries(RANKS, length)
            runner.prefill(ids, boundaries, return_kv=False)  # warm-up at this size
            local[length] = chain[length] = float("inf")
            for _ in range(repeats):  # interleaved, the fastest of each counts
                local[length] = min(local[length], single_process_ttft(model, ids, threads, 1))
                chain[length] = min(chain[length],
                                    runner.prefill(ids, boundaries, return_kv=False).ttft_s)
            print(f"L={length}: local {local[length] * 1e3:.1f} ms, chain "
                  f"{chain[length] * 1e3:.1f} ms", flush=True)
    element = torch.empty(0, dtype=dtype).element_size()
    per_token = kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads,
                                   config.head_dim, element)
    return {"run": run_record(), "local_threads": threads, "chain_ranks": RANKS, "table": table.name,
            "dtype": source.dtype,
            "kv_bytes_per_token": int(per_token),
            "prefill_local_s": local, "prefill_chain_s": chain}


def _interpolate(points: dict[int, float], length: float) -> float:
    """Linear between measured lengths (and beyond the ends, along the nearest segment)."""
    xs = sorted(points)
    right = next((i for i, x in enumerate(xs) if x >= length), len(xs) - 1)
    right = max(right, 1)
    x0, x1 = xs[right - 1], xs[right]
    return points[x0] + (points[x1] - points[x0]) * (length - x0) / (x1 - x0)


def served_p50(served: dict) -> dict[tuple[str, int], float]:
    pooled: dict[tuple[str, int], list[float]] = {}
    for entry in served["rounds"]:
        if entry["tree"] != "this":
            continue
        for cell, values in entry["ttft_s"].items():
            route, length = cell.split("/")
            pooled.setdefault((route, int(length)), []).extend(values)
    return {key: statistics.median(values) for key, values in pooled.items()}


def validation(measured: dict, served: dict, bandwidth: float) -> tuple[list[list], dict, int | None]:
    local = {int(k): v for k, v in measured["prefill_local_s"].items()}
    chain = {int(k): v for k, v in measured["prefill_chain_s"].items()}
    per_token = measured["kv_bytes_per_token"]
    p50 = served_p50(served)
    lengths = sorted({length for _, length in p50})
    shortest = lengths[0]
    components = {
        "local": lambda n: _interpolate(local, n),
        "chain": lambda n: chain_ttft_s(_interpolate(chain, n), n, per_token, Link(bandwidth)),
    }
    hops = {route: p50[(route, shortest)] - components[route](shortest) for route in components}
    rows = []
    for route, component in components.items():
        for length in lengths:
            predicted = hops[route] + component(length)
            measured_s = p50[(route, length)]
            error = predicted / measured_s - 1
            fitted = " (fits the hop)" if length == shortest else ""
            rows.append([route, length, f"{component(length) * 1e3:.1f}",
                         f"{predicted * 1e3:.1f}{fitted}", f"{measured_s * 1e3:.1f}",
                         f"{error:+.0%}" if not fitted else "-"])
    max_context = max(local)
    break_even = next((n for n in range(1, max_context + 1)
                       if hops["chain"] + components["chain"](n) < hops["local"] + components["local"](n)),
                      None)
    return rows, hops, break_even


# --- the GPU projection: inputs named, none measured here -----------------------------------

GPU_INPUTS = [
    ("model", "8B, Llama-3-8B's shape: 32 layers, hidden 4096, 8 KV heads of 128, bf16",
     "the model card's config.json"),
    ("H100 bf16 dense peak", "989 TFLOP/s", "NVIDIA H100 SXM datasheet"),
    ("prefill utilisation", "50% of peak", ("an assumption (eager kernels reach less, CUDA graphs and "
     "FlashAttention more)")),
    ("prefill FLOPs", "2 x params x L + 2 x layers x L^2 x hidden", "dense matmuls plus causal attention"),
    ("chain of n GPUs", "TTFT(1)/2 x (1/n + 1/n^2)", ("KV-Runahead's lower bound (the paper's equation), "
     "an upper bound on what a chain gains")),
    ("KV bytes per token", "32 x (2 x 8 x 128 x 2 + 8) = 131,328", ("PushKV's payload; x 0.5 with "
     "PyramidInfer's default keep ratio")),
    ("links", ("100 and 400 Gbit/s at 90% (RDMA, NIXL); gRPC at the rate PushKV reached here, "
     "at most the link's"), "line rates; PushKV's CPU-bound rate from docs/benchmarks/kv_transfer.md"),
    ("the chain's extra hop", "1 ms", ("an assumption: one more gRPC round trip inside a cluster "
     "(gateway -> chain -> decode pod against gateway -> decode pod)")),
]
GPU_EXTRA_HOP_S = 1e-3
GPU_PARAMS, GPU_LAYERS, GPU_HIDDEN = 8.0e9, 32, 4096
GPU_FLOPS = 989e12 * 0.5
GPU_KV_BYTES_PER_TOKEN = kv_bytes_per_token(GPU_LAYERS, 8, 128, 2)
GPU_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)


def gpu_prefill_s(length: int, ranks: int = 1) -> float:
    one = (2 * GPU_PARAMS * length + 2 * GPU_LAYERS * length**2 * GPU_HIDDEN) / GPU_FLOPS
    return one if ranks == 1 else one / 2 * (1 / ranks + 1 / ranks**2)


def gpu_chain_s(length: int, ranks: int, rate: float, keep: float) -> float:
    return chain_ttft_s(gpu_prefill_s(length, ranks), length, GPU_KV_BYTES_PER_TOKEN * keep,
                        Link(rate, GPU_EXTRA_HOP_S))


def gpu_projection(grpc_rate: float) -> tuple[list[list], list[list]]:
    links = {"100G RDMA": 100e9 / 8 * 0.9, "400G RDMA": 400e9 / 8 * 0.9,
             "100G gRPC": min(100e9 / 8, grpc_rate)}
    rows = [[length, f"{gpu_prefill_s(length) * 1e3:.0f}"]
            + [f"{gpu_chain_s(length, ranks, links[link], 1.0) * 1e3:.0f}"
               for ranks in (2, 4) for link in ("100G RDMA", "100G gRPC")]
            for length in GPU_LENGTHS]
    even = []
    for ranks in (2, 4):
        for link, rate in links.items():
            for keep in (1.0, 0.5):
                found = next((n for n in range(16, 131073, 16)
                              if gpu_chain_s(n, ranks, rate, keep) < gpu_prefill_s(n)), None)
                even.append([ranks, link, f"{keep:g}", f"{found:,}" if found else "never (up to 128k)"])
    return rows, even


def _table_break_even(results: dict) -> int:
    """What `baton up`'s chain advertises: its table's compute, and the KV (compressed as the
    deployment's default says) over the link its configuration assumes."""
    from baton.config import ChainConfig, PyramidConfig
    from baton.runahead import PartitionTable

    table = PartitionTable.load()
    assert table.name == results["table"], "measured with another partition table"
    chain, pyramid = ChainConfig(), PyramidConfig()
    kept = pyramid.keep_ratio if pyramid.enabled else 1.0
    return table.break_even(results["chain_ranks"], "cpu", results["kv_bytes_per_token"] * kept,
                            Link(chain.kv_link_gb_per_s * 1e9, chain.extra_hop_ms / 1e3))


def report(results: dict, served: dict, transfer: dict) -> str:
    pooled = [s for entry in transfer["rounds"] for s in entry[OWN_GRPC]]
    tcp = [s for entry in transfer["rounds"] for s in entry[OWN_TCP]]
    bandwidth = transfer["total_bytes"] / statistics.median(pooled)
    grpc_efficiency = statistics.median(tcp) / statistics.median(pooled)
    rows, hops, break_even = validation(results, served, bandwidth)
    errors = [abs(float(row[-1].rstrip("%")) / 100) for row in rows if row[-1] != "-"]
    local = {int(k): v for k, v in results["prefill_local_s"].items()}
    chain = {int(k): v for k, v in results["prefill_chain_s"].items()}
    gpu_rows, gpu_even = gpu_projection(bandwidth)
    met = max(errors) <= GOAL_ERROR
    dtype = results.get("dtype", "float32")  # results of before it was recorded were fp32's
    precision = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)
    return "\n".join([
        report_header("Where disaggregation pays: predicted against measured time to first token",
                      "bench/pd_model.py", "pd-model", results),
        (f"With the served TTFTs of [route-ttft-results.json.gz](route-ttft-results.json.gz) "
         f"(commit `{recorded_run(served)['commit']}`, {recorded_run(served)['started']}) and "
         f"the PushKV rate of [kv-transfer-results.json.gz](kv-transfer-results.json.gz) (commit "
         f"`{recorded_run(transfer)['commit']}`, {recorded_run(transfer)['started']})."),
        "",
        "## The model",
        "",
        "    TTFT_local(L) = hop_local + prefill_1(L)",
        "    TTFT_chain(L) = hop_chain + prefill_chain(L) + kv_bytes(L) / bandwidth",
        "",
        markdown_table(["input", "value", "source"], [
            ["prefill_1(L)", ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in sorted(local.items())),
             (f"measured: one process, {results['local_threads']} threads (a lone decode pod's), "
             f"shipped model, {precision}, fastest of the rounds")],
            ["prefill_chain(L)", ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in sorted(chain.items())),
             (f"measured: `LocalChain`, {results['chain_ranks']} ranks of 1 thread, gloo, partition "
             f"table `{results['table']}`")],
            ["kv_bytes per token", f"{results['kv_bytes_per_token']:,} B",
             f"the model's shape, {precision}, compression off as in the served runs"],
            ["bandwidth", f"{bandwidth / 1e9:.2f} GB/s", "gRPC PushKV end to end into a decode pod's process, docs/benchmarks/kv_transfer.md"],
            ["hop_local", f"{hops['local'] * 1e3:.1f} ms", "fitted at the shortest served length"],
            ["hop_chain", f"{hops['chain'] * 1e3:.1f} ms", "fitted at the shortest served length"],
        ]),
        "",
        "## Predicted against measured (`baton up`, P50 TTFT)",
        "",
        markdown_table(["route", "prompt tokens", "compute + transfer ms", "predicted ms",
                        "measured ms", "error"], rows),
        "",
        (f"Largest error {max(errors):.0%} (goal: within {GOAL_ERROR:.0%}) — "
         f"{'met' if met else 'NOT met'}."),
        "",
        (f"Break-even on this machine: "
         f"{f'a chain wins from {break_even} tokens' if break_even else 'none'} within the shipped "
         f"model's {max(local)}-token context. The chain "
         "advertises its break-even by the same rule, from its partition table's measured "
         "compute and its configured link (`chain.kv_link_gb_per_s`, `chain.extra_hop_ms`), "
         f"here {_table_break_even(results)} tokens."),
        "",
        "## Projection: an 8B model on H100s",
        "",
        "Not measured: the same equations with these inputs.",
        "",
        markdown_table(["input", "value", "source"], [list(row) for row in GPU_INPUTS]),
        "",
        markdown_table(["prompt tokens", "one GPU prefills it (ms)", "2-GPU chain + 100G RDMA (ms)",
                        "2-GPU chain + 100G gRPC (ms)", "4-GPU chain + 100G RDMA (ms)",
                        "4-GPU chain + 100G gRPC (ms)"], gpu_rows),
        "",
        "(KV uncompressed; a chain's TTFT includes its transfer and its extra hop.)",
        "",
        "Break-even prompt length, chain + transfer against one GPU prefilling it on the decode pod:",
        "",
        markdown_table(["chain GPUs", "link", "KV kept", "a chain wins from"], gpu_even),
        "",
        ("The chain's bound assumes every GPU keeps its utilisation on its slice, so the short "
         "break-evens above are lower bounds. The gRPC rows take PushKV's rate as measured "
         f"here ({bandwidth / 1e9:.2f} GB/s, {grpc_efficiency:.2f} of raw TCP)."),
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure the prefill rates first")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--render", "--report-only", dest="render", action="store_true",
                        help="render the report again from the committed raw results (the default "
                             "without --measure)")
    args = parser.parse_args()
    if args.measure and not args.render:
        save_results("pd-model", measure(args.repeats))
    write_report("pd-model.md", report(*map(load_results, ("pd-model", "route-ttft", "kv-transfer"))))


if __name__ == "__main__":
    main()
