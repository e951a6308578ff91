"""`baton tune-partitions`: measure KV-Runahead partitions on this machine and write a table.

Example (what produced the shipped CPU development table)::

    baton tune-partitions --ranks 2 --lengths 1024,2048,4096,8192 --preset random-50m \\
        --output services/baton/runahead/tables/cpu-dev.json
"""

from __future__ import annotations

import argparse
import platform


def _lengths(text: str) -> list[int]:
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"lengths must be comma-separated integers, got {text!r}") from e
    if not lengths or lengths[0] < 2:
        raise argparse.ArgumentTypeError(f"lengths must be integers >= 2, got {text!r}")
    return lengths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="processes in the chain (default 2)")
    parser.add_argument("--lengths", type=_lengths, default=[1024, 2048, 4096, 8192],
                        help="comma-separated prompt lengths to tune (default 1024,2048,4096,8192)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="", help="checkpoint directory (default: the shipped model)")
    source.add_argument("--preset", default="", help="random-weight model preset, e.g. random-50m")
    parser.add_argument("--output", default="partitions.json",
                        help="table to write; an existing table keeps its other entries")
    parser.add_argument("--name", default="", help="table name (default: the output file's stem)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per probe; the fastest counts")
    parser.add_argument("--min-stride", type=int, default=32, help="finest boundary step in tokens")
    parser.add_argument("--coarse-divisions", type=int, default=8,
                        help="first grid stride is C / this (p > 2)")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="a rank waiting longer than this on a peer gives up")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch
    from tqdm import tqdm

    from baton.runahead import LocalChain, ModelSource, PartitionTable
    from baton.runahead.tuner import SearchSettings, tune

    if args.ranks < 2:
        raise ValueError(f"--ranks must be >= 2 to tune a chain, got {args.ranks}")
    settings = SearchSettings(args.coarse_divisions, args.min_stride, args.repeats)
    source = ModelSource(path=args.model, preset=args.preset)
    config = source.config()
    if args.lengths[-1] > config.max_position_embeddings:
        raise ValueError(f"length {args.lengths[-1]} is beyond the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")
    output = Path(args.output)
    table = PartitionTable.from_file(output) if output.is_file() else PartitionTable(
        args.name or output.stem)
    table.measured_on = {"model": args.preset or args.model or "shipped", "device": "cpu",
                         "machine": platform.node(),
                         "cpus": torch.get_num_threads(), "threads_per_rank": 1,
                         "single_process_threads": args.ranks, "repeats": args.repeats,
                         "min_stride": args.min_stride}
    model = source.load(torch.device("cpu"))
    with LocalChain(source, args.ranks, timeout_s=args.timeout_s) as chain, \
            tqdm(total=len(args.lengths), desc=f"tuning p={args.ranks}", unit="length") as progress:
        tune(chain, model, args.lengths, settings, table, progress, on_entry=lambda t: t.save(output))
    for entry in sorted(table.entries, key=lambda e: (e.ranks, e.context_length)):
        if entry.ranks == args.ranks:
            print(f"p={entry.ranks} C={entry.context_length}: fractions {entry.fractions} "
                  f"ttft {entry.ttft_s:.3f}s (even {entry.ttft_even_s:.3f}s, "
                  f"one process {entry.ttft_single_s:.3f}s)")
    print(f"chain of {args.ranks} pays off from C={table.min_context[args.ranks]}; wrote {output}")
    return 0
