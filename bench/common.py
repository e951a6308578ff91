"""Shared helpers of the benchmark scripts: timing, machine description, report writing."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPORT_DIR = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    # The vector instructions decide which kernels run (baton's own need AVX-512 with BF16;
    # torch's and vLLM's pick a build per instruction set): two "AMD EPYC" differ here.
    vectors = torch.backends.cpu.get_cpu_capability()
    if vectors.startswith("AVX512") and torch.cpu._is_avx512_bf16_supported():
        vectors += " with BF16"
    return (f"{os.cpu_count()} CPU cores ({cpu}, {vectors}), {device}, torch {torch.__version__}, "
            f"load average {os.getloadavg()[0]:.1f} at start")


def median_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(name: str, text: str) -> Path:
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    path = REPORT_DIR / name
    path.write_text(text)
    print(f"wrote {path}")
    return path


def git(*args: str) -> str:
    """``git *args`` in this repository, its output stripped."""
    return subprocess.run(["git", *args], cwd=REPORT_DIR.parents[1], check=True,
                          capture_output=True, text=True).stdout.strip()
