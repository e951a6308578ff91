"""Shared helpers of the benchmark scripts: timing, the run's record, raw results, reports.

Every report under docs/benchmarks/ is rendered from raw results committed beside it
(``NAME-results.json.gz``) and opens with the same header (``report_header``): the script,
the command line, the commit and the machine, all as the run recorded them (``run_record``).
A CPU's model name alone does not say which kernels ran: two hosts sold under one name
differ in their vector instructions, so the record names those too.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REPORT_DIR = ROOT / "docs" / "benchmarks"
# The /proc/cpuinfo flags that decide which kernels run (baton's, torch's, vLLM's).
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
# Older records named them as torch does (``torch.backends.cpu.get_cpu_capability``).
TORCH_VECTORS = {"AVX2": "AVX2 only", "AVX512": "AVX-512 without BF16",
                 "AVX512 with BF16": "AVX-512 with BF16"}


def git(*args: str) -> str:
    """``git *args`` in this repository, its output stripped."""
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def commit() -> str:
    """The commit measured: its short hash, with "+dirty" when tracked files had changes. A
    copy of the tree made elsewhere (a lent GPU machine's) names it in BATON_COMMIT."""
    if os.environ.get("BATON_COMMIT"):
        return os.environ["BATON_COMMIT"]
    try:
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git history here)"


def gpu() -> dict | None:
    """The GPU as torch and the driver see it: name, driver and CUDA versions."""
    if not torch.cuda.is_available():
        return None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                check=False, capture_output=True, text=True, timeout=30).stdout.split()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        driver = "unknown"
    return {"name": torch.cuda.get_device_name(0), "driver": driver, "cuda": torch.version.cuda}


def machine() -> dict:
    """The host as /proc/cpuinfo and torch see it: CPU model, vector flags, cores, GPU."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "vector_flags": [flag for flag in VECTOR_FLAGS if flag in flags],
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": gpu(),
            "torch": torch.__version__, "load_average_start": round(os.getloadavg()[0], 1)}


def instruction_sets(flags: list[str]) -> str:
    """"AVX2 only", "AVX-512 without BF16", "AVX-512 with BF16, AMX", ... from cpuinfo flags."""
    if "avx512f" in flags:
        text = "AVX-512 with BF16" if "avx512_bf16" in flags else "AVX-512 without BF16"
    elif "avx2" in flags:
        text = "AVX2 only"
    else:
        text = "no AVX2"
    return text + (", AMX" if any(flag.startswith("amx") for flag in flags) else "")


def describe_machine(recorded: dict | str) -> str:
    """One line for a report. Results written before ``machine()`` existed hold that line
    already (``machine_description``)."""
    if isinstance(recorded, str):  # an older record: torch's names, see TORCH_VECTORS
        return re.sub(r"\(([^,()]+), (AVX512 with BF16|AVX512|AVX2)\)",
                      lambda found: f"({found[1]}, {TORCH_VECTORS[found[2]]})", recorded)
    gpu = recorded["gpu"] or "no GPU"
    if isinstance(gpu, dict):
        gpu = f"{gpu['name']} (driver {gpu['driver']}, CUDA {gpu['cuda']})"
    return (f"{recorded['cores']} CPU cores ({recorded['cpu']}, "
            f"{instruction_sets(recorded['vector_flags'])}), {gpu}, torch {recorded['torch']}, "
            f"load average {recorded['load_average_start']} at start")


def machine_description() -> str:
    """``describe_machine`` of this host now."""
    return describe_machine(machine())


def command_line(argv: list[str] | None = None) -> str:
    """How this run was started, as one could type it again from the repository's root."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *argv[1:]])


def run_record(argv: list[str] | None = None) -> dict:
    """What every raw result file keeps under "run": commit, command, start time, machine."""
    return {"commit": commit(), "command": command_line(argv),
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine()}


def recorded_run(results: dict) -> dict:
    """The run's record: ``results["run"]``; results written before it existed kept the
    commit (full hash, with a ``clean`` or ``dirty`` flag) and the start time at the top or
    under "provenance", and the machine as one line."""
    if "run" in results:
        return results["run"]
    older = results.get("provenance", results)
    if "dirty" in older or "clean" in older:
        dirty = older.get("dirty", not older.get("clean", True))
        label = older["commit"][:12] + ("+dirty" if dirty else "")
    else:
        label = older["commit"][:12] + " (whether its tree had changes was not recorded)"
    return {"commit": label, "command": None,
            "started": older["started"], "machine": results.get("machine", older.get("machine"))}


def results_path(name: str) -> Path:
    """Where the raw results of report ``name`` (e.g. "runahead") lie, beside the report."""
    return REPORT_DIR / f"{name}-results.json.gz"


def save_results(name: str, results: dict) -> Path:
    """Write raw results (the same results give the same bytes: gzip without a time stamp)."""
    path = results_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as file, gzip.GzipFile(filename="", fileobj=file, mode="wb",
                                                mtime=0) as packed:
        packed.write(json.dumps(results, separators=(",", ":")).encode())
    print(f"wrote {path}")
    return path


def load_results(name: str) -> dict:
    with gzip.open(results_path(name), "rt") as handle:
        return json.load(handle)


def report_header(title: str, script: str, name: str, results: dict,
                  command: str | None = None) -> str:
    """A report's title and provenance: the script that measured it and renders it, the raw
    results it comes from, the command line, the commit and the machine. ``command``: what
    ran, for results recorded before the run kept its command line."""
    run = recorded_run(results)
    raw = results_path(name).name
    command = run["command"] or command
    measured = (f"`{command}`" if command else
                f"`{script}` (a run from before its command line was recorded)")
    commit_text = run["commit"].split(" ", 1)
    return "\n".join([
        f"# {title}",
        "",
        (f"Measured by {measured} at commit `{commit_text[0]}`{' ' + commit_text[1] if len(commit_text) > 1 else ''}, "
         f"started {run['started']}; rendered from the raw results [{raw}]({raw}) by "
         f"`{command or 'python ' + script} --render`."),
        "",
        f"Machine: {describe_machine(run['machine'])}.",
        "",
    ])


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
