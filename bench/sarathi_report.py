"""The SARATHI benchmark's report: tables, plots, the goal check and the notes that explain them.

Kept apart from ``sarathi.py``, which measures; everything here only formats what it measured.
"""

from __future__ import annotations

from common import REPORT_DIR, markdown_table
from sarathi_results import IterationCosts, RunStats

POLICIES = ("sarathi", "separate", "orca")


def iteration_table(costs: list[IterationCosts]) -> str:
    rows = [[c.batch, c.budget, c.budget - (c.batch - 1), f"{c.prefill_only_s * 1e3:.1f}",
             f"{c.mixed_s * 1e3:.1f}", f"{c.marginal_s * 1e3:.1f}", f"{c.decode_only_s * 1e3:.1f}",
             _decode_gain(c), f"{c.end_to_end_ceiling:.2f}x"] for c in costs]
    return markdown_table(["B", "C", "chunk", "chunk alone (ms)", "chunk + B-1 decodes (ms)",
                           "decodes' share (ms)", "B-1 decodes alone (ms)",
                           "decode throughput, piggybacked vs alone", "end-to-end ceiling"], rows)


def _decode_gain(costs: IterationCosts) -> str:
    """The piggybacked gain, or why there is none to print: a mixed iteration no slower than
    its chunk alone leaves the decodes' share at the noise, and the ratio unbounded."""
    if costs.marginal_s <= 0:
        return "unbounded (share within noise)"
    return f"{costs.decode_gain:.2f}x"


def table(results: list[RunStats]) -> str:
    rows = []
    baseline = {r.workload.key: r for r in results if r.policy == "separate"}
    for r in results:
        w = r.workload
        base = baseline[w.key]
        rows.append([r.policy, w.batch, w.prompt_len, w.decode_len, f"{w.ratio:.0f}", w.budget,
                     f"{r.decode_tps:.0f}", f"{r.decode_tps / base.decode_tps:.2f}x",
                     f"{r.end_to_end_tps:.0f}", f"{r.end_to_end_tps / base.end_to_end_tps:.2f}x",
                     f"{r.whole_run_tps:.0f}", f"{r.tbt_ms(50):.0f}", f"{r.tbt_ms(99):.0f}",
                     r.iterations])
    return markdown_table(["policy", "B", "P", "D", "P:D", "C", "decode tok/s", "vs separate",
                           "e2e tok/s", "vs separate", "whole-run tok/s", "TBT p50 ms",
                           "TBT p99 ms", "iterations"], rows)


def plot(results: list[RunStats], x_of, x_label: str, name: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for policy in POLICIES:
        runs = [r for r in results if r.policy == policy]
        xs = [x_of(r.workload) for r in runs]
        axes[0].plot(xs, [r.decode_tps for r in runs], marker="o", label=policy)
        axes[1].plot(xs, [r.end_to_end_tps for r in runs], marker="o", label=policy)
        axes[2].plot(xs, [r.tbt_ms(99) for r in runs], marker="o", label=policy)
    for axis, ylabel in zip(axes, ("decode tokens/s", "end-to-end tokens/s", "P99 time between tokens (ms)")):
        axis.set_xlabel(x_label)
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(REPORT_DIR / name, dpi=90)
    plt.close(figure)
    return name


ITERATION_INTRO = """
## One decode-maximal batch against its parts (MODEL)

SARATHI's own measurement, free of workload effects: B-1 sequences are
decoding; each round times a decode-only iteration, then the same decodes
with one chunk of C-(B-1) prompt tokens (a mixed iteration), then the chunk
alone as a prefill-only iteration, back to back. Figures are medians of 12
rounds. The decodes' share is the mixed time minus the chunk alone. The
end-to-end ceiling, (chunk alone + decodes alone) / mixed, is what a perfectly
balanced workload could gain over separate phases with these iteration costs.

"""

def goal_check(runs: list[RunStats], costs: list[IterationCosts], label: str = "random-50m",
               budget: int = 256) -> str:
    """The goal at the balanced point P:D = C/(B-1): the headline at B=8, C=``budget`` (one
    decode-maximal batch against its parts, and the steady state of a workload), and every
    other balanced point measured (of the model ``label``)."""
    per_batch = next((c for c in costs if (c.batch, c.budget) == (8, budget)), None)
    by_workload: dict[tuple, dict[str, RunStats]] = {}
    for r in runs:
        by_workload.setdefault(r.workload.key, {})[r.policy] = r
    rows, headline = [], ""
    for policies in by_workload.values():
        ours, base = policies["sarathi"], policies["separate"]
        decode_gain = ours.decode_tps / base.decode_tps
        e2e_gain = ours.end_to_end_tps / base.end_to_end_tps
        w = ours.workload
        rows.append([w.batch, w.budget, w.prompt_len, w.decode_len, f"{w.ratio:.0f}",
                     f"{decode_gain:.2f}x", f"{e2e_gain:.2f}x",
                     f"{ours.tbt_ms(99):.0f} / {base.tbt_ms(99):.0f} / {policies['orca'].tbt_ms(99):.0f}"])
        if (w.batch, w.budget) == (8, budget) and not headline:
            batch_line = "" if per_batch is None else (
                f"* decode throughput of one decode-maximal batch (7 decodes on a "
                f"{budget - 7}-token chunk) "
                f"vs the same decodes alone: **{per_batch.decode_gain:.2f}x** (goal >= 2x: "
                f"{'met' if per_batch.decode_gain >= 2 else 'not met'})\n")
            headline = (
                f"## Goal at the balanced point ({label}, B=8, C={budget}, P:D={w.ratio:.0f})\n\n"
                + batch_line +
                f"* decode throughput over a workload's steady state vs separate phases: "
                f"**{decode_gain:.2f}x** (goal >= 2x: {'met' if decode_gain >= 2 else 'not met'})\n"
                f"* end-to-end throughput vs separate phases: **{e2e_gain:.2f}x** (goal >= 1.15x: "
                f"{'met' if e2e_gain >= 1.15 else 'not met'})\n"
                f"* P99 time between tokens: sarathi {ours.tbt_ms(99):.0f} ms, separate "
                f"{base.tbt_ms(99):.0f} ms, orca {policies['orca'].tbt_ms(99):.0f} ms\n")
    if not rows:
        return ""
    return (headline + "\nEvery balanced point measured (SARATHI against separate phases):\n\n"
            + markdown_table(["B", "C", "P", "D", "P:D", "decode", "end-to-end",
                              "TBT p99 ms: sarathi / separate / orca"], rows) + "\n")
