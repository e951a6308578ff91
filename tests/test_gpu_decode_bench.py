"""bench/gpu_decode.py runs end to end (``--smoke``: a tiny model on the CPU, no report file),
so that a session with the GPU machine spends its time measuring, not debugging the script."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "bench")]
import gpu_decode


def test_the_gpu_decode_benchmark_runs_and_reports_every_section(capsys):
    assert gpu_decode.main(["--device", "cpu", "--smoke"]) == 0
    report = capsys.readouterr().out
    for heading in ("## Decode steps replayed from CUDA graphs",
                    "## Batch-1 decode against the memory-bandwidth bound",
                    "## Greedy tokens against transformers", "## KV off and onto the device"):
        assert heading in report
    assert "CPU smoke run, not a figure" in report
    # both batches measured, each eager and through the static (uncaptured) replay path
    assert "| 1 |" in report and "| 3 |" in report
    assert "not transformers' best" in report
