"""Where a decode step's time goes on a GPU: the kernels of a batch-1 step of the ~1.2B random
Llama (bench/gpu_decode.py's model) replayed from its CUDA graph and run eagerly, counted and
timed by torch's profiler, against each step's wall time.

Writes docs/benchmarks/decode-gpu-profile.md and decode-gpu-profile-results.json.gz.

    python bench/gpu_profile.py              # on a CUDA machine
    python bench/gpu_profile.py --render     # the report again, from the results
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.kv import KVPool
from baton.model.presets import PRESETS, random_model
from baton.sarathi.decode_graphs import DecodeGraphs
from baton.sarathi.runner import ModelRunner
from common import (
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)
from gpu_decode import BLOCK_SIZE, PROMPT, decode_iterations, start_sequences, synchronize

STEPS = 8  # decode steps profiled per mode
TOP = 12  # kernels named in the report, by device time


def profiled(run_steps, device: torch.device) -> dict:
    """Wall time and kernels of STEPS decode steps: per step, the wall time, the kernels
    launched, their summed device time; and each kernel name's share."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run_steps()  # warm (and capture)
    synchronize(device)
    started = time.perf_counter()
    run_steps()
    synchronize(device)
    wall = (time.perf_counter() - started) / STEPS
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        run_steps()
        synchronize(device)
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for event in trace.events():
        if event.device_type == DeviceType.CUDA:
            by_name[event.name].append(event.time_range.elapsed_us())
    kernels = sum(len(times) for times in by_name.values()) / STEPS
    device_us = sum(sum(times) for times in by_name.values()) / STEPS
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP]
    return {"wall_s": wall, "kernels_per_step": kernels, "device_us_per_step": device_us,
            "top": [{"name": name, "per_step": len(times) / STEPS, "us_per_step": sum(times) / STEPS}
                    for name, times in top]}


def measure(device: torch.device, config=None) -> dict:
    """``config``: another model shape than random-1b's (a check of the script itself)."""
    model = random_model(config or PRESETS["random-1b"], dtype=torch.bfloat16, device=device,
                         draw_on_device=True)
    config = model.config
    results = {"weight_bytes": sum(p.nbytes for p in model.parameters()), "modes": {}}
    for mode in ("graphs", "eager"):
        pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, BLOCK_SIZE,
                      config.num_hidden_layers * 64 + 1, model.dtype, device)
        runner = ModelRunner(model, pool, DecodeGraphs(model, pool) if mode == "graphs" else None)
        generator = torch.Generator().manual_seed(0)

        def run_steps(runner=runner, pool=pool, generator=generator):
            seqs = start_sequences(model, pool, runner, 1, generator)
            synchronize(device)
            decode_iterations(runner, seqs, STEPS)

        results["modes"][mode] = profiled(run_steps, device)
        row = results["modes"][mode]
        print(f"[{mode}] {row['wall_s'] * 1e3:.2f} ms/step wall, {row['kernels_per_step']:.0f} kernels, "
              f"{row['device_us_per_step'] / 1e3:.2f} ms of kernels", flush=True)
    return results


def report(results: dict) -> str:
    header = report_header("Where a batch-1 decode step's time goes on a GPU", "bench/gpu_profile.py",
                           "decode-gpu-profile", results)
    summary, tops = [], []
    for mode, row in results["modes"].items():
        summary.append([mode, f"{row['wall_s'] * 1e3:.2f}", f"{row['kernels_per_step']:.0f}",
                        f"{row['device_us_per_step'] / 1e3:.2f}",
                        f"{row['device_us_per_step'] / max(row['kernels_per_step'], 1):.1f}"])
        tops.append(f"### {mode}\n\n" + markdown_table(
            ["kernel", "per step", "us per step"],
            [[f"`{item['name'][:90]}`", f"{item['per_step']:.0f}", f"{item['us_per_step']:.0f}"]
             for item in row["top"]]))
    tables = "\n\n".join(tops)
    return f"""{header}
GPU run, bfloat16: the ~1.2B-parameter random Llama of `bench/gpu_decode.py` ({results['weight_bytes'] / 1e9:.2f}
GB of weights), one sequence of a {PROMPT}-token prompt, {STEPS} decode steps through the
engine's runner, replayed from the step's CUDA graph and run eagerly; torch's profiler
counts the kernels and sums their device time. Wall time is per step, the greedy token on
the host each time (without the profiler).

{markdown_table(["mode", "wall ms/step", "kernels per step", "kernel time ms/step", "us per kernel"], summary)}

The kernels with the most device time, per step:

{tables}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true",
                        help="render the report again from the committed raw results")
    args = parser.parse_args(argv)
    if not args.render:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device")
        record = run_record([__file__, *(sys.argv[1:] if argv is None else argv)])
        save_results("decode-gpu-profile", {"run": record, **measure(torch.device("cuda"))})
    write_report("decode-gpu-profile.md", report(load_results("decode-gpu-profile")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
