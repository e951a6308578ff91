"""KV-Runahead time to first token on this machine: one process vs TSP vs KV-Runahead.

Writes docs/benchmarks/runahead.md and runahead.png (from runahead-results.json.gz beside
them): TTFT against prompt length
for one process with 2 threads, TSP with 2 ranks, and KV-Runahead with even and
with tuned slices (2 ranks, 1 thread each; tuned = the shipped partition
table), on the ~50M-parameter random-weight preset and on the shipped model,
side by side in one run, with the paper's lower bound
TTFT(1)/2 * (1/p + 1/p^2), TTFT(1) being one process with one thread (the
resources of one rank). Every figure is the fastest of --repeats runs, the
methods interleaved so that background load hits them alike.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.runahead import LocalChain, ModelSource, PartitionTable
from baton.runahead.tuner import single_process_ttft
from common import (
    REPORT_DIR,
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)

RANKS = 2
METHODS = ("one process, 2 threads", "TSP", "KV-Runahead even", "KV-Runahead tuned")
GOAL_LENGTH = 4096
GOAL_VS_TSP, GOAL_VS_SINGLE = 1.3, 1.5


def lower_bound(ttft_one_thread_s: float, ranks: int = RANKS) -> float:
    return ttft_one_thread_s / 2 * (1 / ranks + 1 / ranks**2)


def measure_model(source: ModelSource, lengths: list[int], table: PartitionTable,
                  repeats: int) -> list[dict]:
    model = source.load(torch.device("cpu"))
    rows = []
    generator = torch.Generator().manual_seed(0)
    with LocalChain(source, RANKS, table=table, timeout_s=300) as chain:
        for length in lengths:
            token_ids = torch.randint(0, model.config.vocab_size, (length,), generator=generator)
            tuned = table.boundaries(RANKS, length)
            even = chain.boundaries_for(length, "tsp")
            chain.prefill(token_ids, even, return_kv=False)  # warm-up at this size
            best = dict.fromkeys(METHODS, float("inf"))
            sent = {}
            one_thread = float("inf")
            for _ in range(repeats):
                best[METHODS[0]] = min(best[METHODS[0]],
                                       single_process_ttft(model, token_ids, RANKS, 1))
                one_thread = min(one_thread, single_process_ttft(model, token_ids, 1, 1))
                for method, mode, boundaries in ((METHODS[1], "tsp", even),
                                                 (METHODS[2], "runahead", even),
                                                 (METHODS[3], "runahead", tuned)):
                    result = chain.prefill(token_ids, boundaries, mode, return_kv=False)
                    best[method] = min(best[method], result.ttft_s)
                    sent[method] = result.bytes_sent
            rows.append({"length": length, "ttft": best, "tuned": tuned, "sent": sent,
                         "one_thread": one_thread, "bound": lower_bound(one_thread)})
            print(f"C={length}: " + ", ".join(f"{m} {t:.3f}s" for m, t in best.items())
                  + f", bound {rows[-1]['bound']:.3f}s", flush=True)
    return rows


def table_text(rows: list[dict]) -> str:
    headers = ["C", *[f"{m} (s)" for m in METHODS], "one process, 1 thread (s)",
               "lower bound (s)", "tuned b1",
               "tuned vs TSP", "tuned vs one process", "speed-up over 1 thread: 2 threads / chain",
               "KV sent: runahead / TSP (MiB)"]
    body = []
    for row in rows:
        t = row["ttft"]
        body.append([row["length"], *[f"{t[m]:.3f}" for m in METHODS], f"{row['one_thread']:.3f}",
                     f"{row['bound']:.3f}",
                     row["tuned"][1], f"{t['TSP'] / t['KV-Runahead tuned']:.2f}x",
                     f"{t[METHODS[0]] / t['KV-Runahead tuned']:.2f}x",
                     (f"{row['one_thread'] / t[METHODS[0]]:.2f}x / "
                      f"{row['one_thread'] / t['KV-Runahead tuned']:.2f}x"),
                     (f"{row['sent']['KV-Runahead tuned'] / 2**20:.1f} / "
                     f"{row['sent']['TSP'] / 2**20:.1f}")])
    return markdown_table(headers, body)


def goal_text(name: str, rows: list[dict]) -> str:
    long_rows = [r for r in rows if r["length"] >= GOAL_LENGTH]
    if not long_rows:
        return f"* {name}: no length >= {GOAL_LENGTH} measured (the model's context is shorter)."
    lines = []
    for row in long_rows:
        t = row["ttft"]
        vs_tsp = t["TSP"] / t["KV-Runahead tuned"]
        vs_single = t[METHODS[0]] / t["KV-Runahead tuned"]
        verdict = "met" if vs_tsp >= GOAL_VS_TSP and vs_single >= GOAL_VS_SINGLE else "NOT met"
        # What a chain could reach at most without cache effects: one thread's work split
        # into p equal parts with nothing lost to the pipeline's start or the transfers.
        perfect = row["one_thread"] / RANKS
        lines.append(f"* {name}, C={row['length']}: tuned KV-Runahead is {vs_tsp:.2f}x TSP "
                     f"(goal {GOAL_VS_TSP}x) and {vs_single:.2f}x one 2-thread process "
                     f"(goal {GOAL_VS_SINGLE}x): {verdict}. A chain that split one thread's "
                     f"work perfectly ({perfect:.3f} s) would be {t['TSP'] / perfect:.2f}x TSP; "
                     f"this one turns {row['one_thread'] / t['KV-Runahead tuned'] / RANKS:.0%} "
                     f"of its {RANKS} cores into speed.")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for axis, (name, rows) in zip(axes[0], results.items()):
        lengths = [r["length"] for r in rows]
        for method, marker in zip(METHODS, "osv^"):
            axis.plot(lengths, [r["ttft"][method] for r in rows], marker=marker, label=method)
        axis.plot(lengths, [r["bound"] for r in rows], "k--", marker="x", label="lower bound (p=2)")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("prompt length C (tokens)")
        axis.set_ylabel("TTFT (s)")
        axis.set_title(name)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def measure(args: argparse.Namespace) -> dict:
    record = run_record()
    lengths = [int(x) for x in args.lengths.split(",")]
    table = PartitionTable.load(args.table)
    models = {f"{args.preset} (random weights)": ModelSource(preset=args.preset)}
    shipped = None
    if (SHIPPED_MODEL_DIR / "config.json").is_file():
        source = ModelSource(path=str(SHIPPED_MODEL_DIR))
        shipped = {"name": SHIPPED_MODEL_DIR.name,
                   "context": source.config().max_position_embeddings}
        models[f"shipped model ({SHIPPED_MODEL_DIR.name})"] = source
    by_model = {}
    for name, source in models.items():
        usable = [c for c in lengths if c <= source.config().max_position_embeddings]
        print(f"== {name}: {usable}", flush=True)
        by_model[name] = measure_model(source, usable, table, args.repeats)
    return {"run": record, "repeats": args.repeats, "table": table.name,
            "tuned_on": table.measured_on.get("model", "?"), "shipped": shipped,
            "load_average_end": round(os.getloadavg()[0], 1), "models": by_model}


def render(results: dict) -> str:
    plot(results["models"], REPORT_DIR / "runahead.png")
    shipped = results["shipped"]
    shipped_note = (f"The shipped model's context is {shipped['context']} tokens: its rows stop "
                    f"there." if shipped else "The shipped model was not found: its rows are missing.")
    sections = [f"### {name}\n\n{table_text(rows)}" for name, rows in results["models"].items()]
    goals = "\n".join(goal_text(name, rows) for name, rows in results["models"].items())
    header = report_header("KV-Runahead: time to first token", "bench/runahead.py", "runahead",
                           results)
    return f"""{header}
Load average {results['load_average_end']:.1f} at the end.

* Every figure is the fastest of {results['repeats']} interleaved runs. Chain TTFT runs from
  rank 0 receiving the request to the tail holding the first token's logits;
  one process's TTFT is its `prefill()` call.
* Chains: {RANKS} ranks, 1 thread each, gloo over loopback, fp32. Tuned slices come
  from the partition table `{results['table']}` (tuned on `{results['tuned_on']}` by
  `baton tune-partitions`), interpolated for lengths it does not list.
* Lower bound: TTFT(1)/2 * (1/p + 1/p^2) with TTFT(1) = one process with one
  thread (the resources of one rank), p = {RANKS}.
* {shipped_note}

![TTFT vs prompt length](runahead.png)

{(chr(10) * 2).join(sections)}

## Goal: tuned KV-Runahead >= {GOAL_VS_TSP}x TSP and >= {GOAL_VS_SINGLE}x one 2-thread process at C >= {GOAL_LENGTH // 1024}k

{goals}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", default="random-50m")
    parser.add_argument("--table", default="", help="partition table (default: the shipped one)")
    parser.add_argument("--render", action="store_true",
                        help="render the report again from the committed raw results")
    args = parser.parse_args()
    if not args.render:
        save_results("runahead", measure(args))
    write_report("runahead.md", render(load_results("runahead")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
