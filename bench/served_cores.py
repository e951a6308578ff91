"""The service with a core of its own: what ``baton up`` keeps of its engine when the client
and the gateway do not take the engine's cores.

On this 2-core machine the peer benchmark's served runs (``peer/run.py``) put the client, the
gateway and the decode pod's two engine threads on the same two cores: whatever the client
and the gateway spend is taken from the engine, which is not how a cluster runs (the
clients are elsewhere, the gateway on its own pod). This benchmark splits the machine in
two instead:

* the engine alone: ``peer/offline_baton.py`` with one thread, on CPU 0;
* served: ``baton up --threads 1 --chain-ranks 0`` (KV compression off, every prompt
  prefilled on the decode pod, as in the engine), its decode pod moved onto CPU 0 once it
  serves; the client, the gateway and redis on CPU 1. Two clients: this project's
  threaded HTTP client and baton's asyncio gRPC client (``peer/served.py``).

So the decode pod's own costs (gRPC, its event loop, streaming every step, the heartbeat)
share the engine's core, and nothing else does. The peer workload's first 64 requests (64 new
tokens each, greedy, end-of-sequence ignored), fresh processes, the two sides interleaved
for ``--rounds`` rounds, their order flipping every round, each waiting for a quiet
machine. Writes docs/benchmarks/served-cores.md from served-cores-results.json.gz beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))
from common import (
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)
from peer.report import throughput as rate
from peer.run import WORK_DIR, prepare_shipped_model
from peer.workload import make_workload

ENGINE_CPU, SERVICE_CPU = 0, 1
CLIENTS = {"http": "threads, HTTP", "grpc-aio": "asyncio, gRPC"}
SCRIPTS = Path(__file__).resolve().parent / "peer"
NUM_REQUESTS = 64


def prepare_workload() -> Path:
    from baton.model.hub import SHIPPED_MODEL_DIR
    from baton.model.tokenizer import Tokenizer

    workload = make_workload(Tokenizer.from_dir(SHIPPED_MODEL_DIR)).first(NUM_REQUESTS)
    return workload.save(WORK_DIR / "cores-workload.json")


def run_script(command: list[str], env: dict | None, out: Path, label: str, preexec_fn) -> dict:
    """One side in a fresh process (its output in OUT.log; ``preexec_fn`` runs in the child
    before it starts); its JSON result."""
    log = out.with_suffix(".log")
    with log.open("w") as handle:
        completed = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   timeout=1800, check=False, preexec_fn=preexec_fn)
    if completed.returncode != 0:
        raise RuntimeError(f"{label} failed ({completed.returncode}); see {log}")
    return json.loads(out.read_text())


def per_token_us(runs: list[dict], counted) -> float:
    """Median over ``runs`` of the CPU per generated token (µs) of the roles ``counted(role)``."""
    return statistics.median(
        sum(seconds for role, seconds in run["cpu_by_role_s"].items() if counted(role)) * 1e6
        / run["generated_tokens"] for run in runs)


def on_cpu(cpu: int):
    """A ``preexec_fn`` that starts the child on one CPU (its threads and children inherit it)."""
    return lambda: os.sched_setaffinity(0, {cpu})


def run_engine(model_dir: Path, workload: Path, dtype: str, out: Path) -> dict:
    command = [sys.executable, str(SCRIPTS / "offline_baton.py"), str(model_dir), str(workload),
               str(out), "--dtype", dtype, "--threads", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return run_script(command, env, out, f"engine {dtype:8s}", preexec_fn=on_cpu(ENGINE_CPU))


def run_served(model_dir: Path, workload: Path, dtype: str, out: Path, order: int) -> dict:
    command = [sys.executable, str(SCRIPTS / "served.py"), "baton", sys.executable, str(model_dir),
               str(workload), str(out), "--dtype", dtype, "--order", str(order), "--threads", "1",
               "--chain-ranks", "0", "--decode-cpus", str(ENGINE_CPU), "--clients", ",".join(CLIENTS)]
    return run_script(command, None, out, f"served {dtype}", preexec_fn=on_cpu(SERVICE_CPU))


SETUP = """\
* the engine alone: baton's `Engine.step` loop, one thread, on CPU 0;
* served: `baton up --threads 1 --chain-ranks 0`, KV compression off, its decode pod on CPU 0
  (one engine thread, with its gRPC server and event loop); the client, the gateway and
  redis on CPU 1.

The peer workload's first 64 requests (`runs/peer/cores-workload.json`: 50-900 prompt tokens, 64 new
tokens each, greedy, end-of-sequence ignored), all sent at once. Every run is a fresh
process (a fresh cluster) and waits for a quiet machine; the two sides alternate.
"""


def report(results: dict) -> str:
    rounds = results["rounds"]
    lines = [report_header("The service with a core of its own", "bench/served_cores.py",
                           "served-cores", results),
             SETUP, f"Load average {results['load_average_end']:.1f} at the end.", ""]
    summary = []
    for dtype, runs in rounds.items():
        per_round = []
        for index, entry in enumerate(runs):
            engine = rate(entry["engine"])
            cells = [index + 1, f"{engine:,.0f}"]
            for name in CLIENTS:
                served = rate(entry["served"]["clients"][name])
                cells += [f"{served:,.0f}", f"{served / engine:.2f}x"]
            per_round.append(cells)
        headers = ["round", "engine, 1 thread (tok/s)"]
        for label in CLIENTS.values():
            headers += [f"served, {label} (tok/s)", "of the engine"]
        lines += [f"## {dtype}", "", markdown_table(headers, per_round), ""]
        for name, label in CLIENTS.items():
            ratios = [rate(e["served"]["clients"][name]) / rate(e["engine"]) for e in runs]
            summary.append([dtype, label, f"{statistics.median(ratios):.2f}x",
                            f"{min(ratios):.2f}-{max(ratios):.2f}x"])
        lines += [cpu_table(runs), ""]
    lines += ["## Summary: served throughput as a share of the engine's", "",
              markdown_table(["dtype", "client", "median", "range"], summary)]
    return "\n".join(lines) + "\n"


def cpu_table(runs: list[dict]) -> str:
    """CPU per generated token (µs, median over rounds) by process, against the engine alone."""
    roles = ("client", "gateway", "decode pod", "redis")
    engine = statistics.median(e["engine"]["own_cpu_s"] / e["engine"]["generated_tokens"] for e in runs)
    rows = [["engine alone", "", "", f"{engine * 1e6:.0f}", ""]]
    for name, label in CLIENTS.items():
        served = [e["served"]["clients"][name] for e in runs]
        rows.append([f"served, {label}",
                     *[f"{per_token_us(served, lambda r, role=role: r == role):.0f}" for role in roles]])
    return ("CPU per generated token (µs, median over the rounds; /proc, 10 ms ticks):\n\n"
            + markdown_table(["run", *roles], rows))


def one_round(model_dir: Path, workload: Path, dtype: str, index: int) -> dict:
    """The engine and the service, back to back (the order flips every round)."""
    stem = f"cores-{dtype}-{index}"
    sides = {"engine": lambda: run_engine(model_dir, workload, dtype, WORK_DIR / f"{stem}-engine.json"),
             "served": lambda: run_served(model_dir, workload, dtype, WORK_DIR / f"{stem}-served.json",
                                          index)}
    order = list(sides)[::-1] if index % 2 else list(sides)
    return {name: sides[name]() for name in order}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--render", action="store_true",
                        help="render the report again from the committed raw results")
    args = parser.parse_args()
    if args.render:
        write_report("served-cores.md", report(load_results("served-cores")))
        return
    if len(os.sched_getaffinity(0)) < 2:  # skipped, not failed: `make bench` goes on
        print("served_cores.py: skipped, it needs 2 CPUs (one for the engine, one for the rest)")
        return
    model_dir, workload = prepare_shipped_model(), prepare_workload()
    record = run_record()
    rounds: dict[str, list[dict]] = {dtype: [] for dtype in args.dtypes.split(",")}
    for index in range(args.rounds):
        print(f"round {index + 1}/{args.rounds}", flush=True)
        for dtype, runs in rounds.items():
            runs.append(one_round(model_dir, workload, dtype, index))
    save_results("served-cores", {"run": record, "rounds": rounds,
                                  "load_average_end": round(os.getloadavg()[0], 1)})
    write_report("served-cores.md", report(load_results("served-cores")))


if __name__ == "__main__":
    main()
