"""baton against vLLM on this machine: one run, one commit, every table of peer.md.

``make bench-peer`` (``python bench/peer/run.py``); bench/peer/README.md says what it
measures and how long it takes. In order:

1. **Setup**: vLLM's CPU build in its own virtualenv (``vllm_setup``), the shipped model's
   directory (both systems load it), the workload (``workload.py``: 5 sets of 256 prompts).
2. **Sweep** (fp32, offline, the first set), interleaved: each system at every token budget
   of ``--budgets`` and at its own default, then at its best budget with 64, 128 and 256
   sequences running at once (``--max-seqs``; vLLM's default is 256 offline, 128 served;
   baton's 64); each system's best setting is the run with the most generated tokens/s,
   and every later run, offline and served, uses it.
3. **Offline rounds**: vLLM's ``LLMEngine`` step loop against baton's ``Engine.step`` loop,
   every request submitted at once, fresh processes, the order flipping every round, both
   dtypes. In fp32 both must produce identical tokens, or the run fails.
4. **Reference**: baton's engine in fp32 over every set: the tokens every served stream
   must reproduce.
5. **Served rounds**: ``vllm serve`` against ``baton up`` (KV compression off, so both do
   the same work), each started fresh every round at its best budget, both driven by vLLM's
   own client (``vllm bench serve``) over the OpenAI HTTP API, one set of prompts per
   scenario (so a prefix cache gains nothing from an earlier scenario): concurrency 1, 8
   and 64, then Poisson arrivals at two rates below the slower engine's capacity. In fp32
   every stream's text must equal the reference's, or the run fails.

The raw results go to docs/benchmarks/peer-results.json.gz (``results.py``), then
peer.md is rendered from that file alone (``--render`` renders it again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results as raw
from common import run_record, write_report
from report import render, throughput
from vllm_setup import ensure_peer_venv, vllm_environment
from workload import Workload, make_workload

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORK_DIR = ROOT / "runs" / "peer"
THREADS = 2
SYSTEMS = ("vllm", "baton")
BUDGETS = (2048, 4096, 8192, 16384)
MAX_SEQS = (64, 128, 256)  # the sweep's second knob: sequences running at once
SET_SIZE = 256  # requests of one run
RATE_FRACTIONS = (0.25, 0.5)  # the Poisson rates, as fractions of the slower engine's request rate


@dataclass(frozen=True)
class Scenario:
    name: str
    max_concurrency: int | None  # None: no limit (arrivals alone decide)
    request_rate: float  # requests a second; inf: all at once

    def describe(self) -> str:
        if self.request_rate == float("inf"):
            return f"concurrency {self.max_concurrency}"
        return f"Poisson arrivals, {self.request_rate:.1f} requests/s"


def scenarios(rates: tuple[float, ...]) -> list[Scenario]:
    closed = [Scenario(f"c{n}", n, float("inf")) for n in (1, 8, 64)]
    return closed + [Scenario(f"poisson-{i + 1}", None, rate) for i, rate in enumerate(rates)]


def prepare_shipped_model() -> Path:
    """A copy of the shipped model's directory, which both systems load."""
    from baton.model.hub import SHIPPED_MODEL_DIR

    shipped = WORK_DIR / "shipped"
    shipped.mkdir(parents=True, exist_ok=True)
    for source in SHIPPED_MODEL_DIR.iterdir():
        if not (shipped / source.name).exists():
            shutil.copy(source, shipped / source.name)
    return shipped


def prepare_workload(num_sets: int, set_size: int) -> list[Path]:
    """The workload's sets of ``set_size`` prompts, each saved as its own JSON file."""
    from baton.model.hub import SHIPPED_MODEL_DIR
    from baton.model.tokenizer import Tokenizer

    full = make_workload(Tokenizer.from_dir(SHIPPED_MODEL_DIR), num_requests=num_sets * set_size)
    paths = []
    for index in range(num_sets):
        part = Workload(full.prompts[index * set_size:(index + 1) * set_size],
                        full.texts[index * set_size:(index + 1) * set_size], full.warmup,
                        full.new_tokens, full.seed)
        paths.append(part.save(WORK_DIR / f"set-{index}.json"))
    return paths


def run_offline(system: str, peer_python: Path, model_dir: Path, workload: Path, dtype: str,
                setting: dict, out: Path) -> dict:
    """One system's engine over ``workload`` in a fresh process; its JSON result."""
    if system == "vllm":
        python, env = peer_python, vllm_environment(THREADS)
    else:
        python, env = Path(sys.executable), dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    command = [str(python), str(HERE / f"offline_{system}.py"), str(model_dir), str(workload),
               str(out), "--dtype", dtype, "--threads", str(THREADS), *setting_flags(setting)]
    result = run_logged(command, env, out, timeout_s=1800)
    print(f"  {system:5s} {dtype:8s} budget {result.get('token_budget')!s:>6s} "
          f"seqs {result.get('max_seqs')!s:>4s} "
          f"{throughput(result):7.0f} tok/s  others' CPU {result['others_cpu_s']:.2f} s", flush=True)
    return result


def setting_flags(setting: dict) -> list[str]:
    """A system's setting (token budget, max seqs; 0: its default; prefix cache, on unless
    False) as the runners' flags."""
    flags = ["--token-budget", str(setting["token_budget"]), "--max-seqs", str(setting["max_seqs"])]
    return flags + (["--no-prefix-cache"] if setting.get("prefix_cache") is False else [])


def run_logged(command: list[str], env: dict | None, out: Path, timeout_s: float) -> dict:
    log = out.with_suffix(".log")
    with log.open("w") as handle:
        completed = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   timeout=timeout_s, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"{out.stem} failed ({completed.returncode}); see {log}")
    return json.loads(out.read_text())


def run_served(system: str, peer_python: Path, model_dir: Path, workload: Path, dtype: str,
               setting: dict, plan: list[tuple[Scenario, Path]], out: Path) -> dict:
    """One server started fresh, then every scenario of ``plan`` against it (``served.py``)."""
    spec = [{"name": s.name, "prompts_jsonl": str(path), "max_concurrency": s.max_concurrency,
             "request_rate": s.request_rate, "seed": index} for index, (s, path) in enumerate(plan)]
    spec_path = out.with_suffix(".scenarios.json")
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, str(HERE / "served.py"), system, str(peer_python), str(model_dir),
               str(workload), str(out), "--dtype", dtype, *setting_flags(setting),
               "--scenarios", str(spec_path)]
    return run_logged(command, None, out, timeout_s=3600)


def check_identical(what: str, expected: list[str], got: list[str]) -> None:
    """Raises when any of ``got`` differs from ``expected`` (in fp32 every request must agree)."""
    differing = [i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b]
    if differing:
        raise RuntimeError(f"{what}: {len(differing)} of {len(expected)} requests differ from the "
                           f"reference in fp32 (first: request {differing[0]})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="offline rounds per dtype")
    parser.add_argument("--served-rounds", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="dtypes of the offline rounds")
    parser.add_argument("--served-dtypes", default="float32", help="dtypes of the served rounds")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                        help="the token budgets of the sweep (each system's default runs too)")
    parser.add_argument("--max-seqs", default=",".join(map(str, MAX_SEQS)),
                        help="the sweep's numbers of sequences running at once, at the best budget")
    parser.add_argument("--requests", type=int, default=SET_SIZE,
                        help="requests of every run (fewer: a quick check, not a figure)")
    parser.add_argument("--render", "--report-only", dest="render", action="store_true",
                        help="render peer.md again from docs/benchmarks/peer-results.json.gz")
    args = parser.parse_args()
    if args.render:
        write_report("peer.md", render(raw.load()))
        return
    # A quick check is no figure: its results and report stay in runs/peer/.
    results_path = raw.RESULTS_PATH if args.requests >= SET_SIZE else WORK_DIR / "quick-results.json.gz"
    peer_python = ensure_peer_venv()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_shipped_model()
    plan_scenarios = scenarios((1.0, 2.0))  # the names; the rates come after the offline rounds
    sets = prepare_workload(len(plan_scenarios), args.requests)
    workload_info = json.loads(sets[0].read_text())
    results = {"run": run_record(),
               "load_average_start": os.getloadavg(), "threads": THREADS,
               "workload": {"requests": args.requests, "sets": len(sets),
                            "new_tokens": workload_info["new_tokens"], "seed": workload_info["seed"],
                            "prompt_tokens": [Workload.load(s).prompt_tokens for s in sets]},
               "vllm_environment": {k: v for k, v in vllm_environment(THREADS).items()
                                    if k.startswith(("VLLM_", "LD_PRELOAD", "OMP_"))},
               "sweep": [], "offline": [], "served": []}

    print("sweep (fp32): token budgets, then sequences running at once")

    def sweep(system: str, setting: dict) -> None:
        out = WORK_DIR / f"sweep-{system}-{setting['token_budget']}-{setting['max_seqs']}.json"
        run = run_offline(system, peer_python, model_dir, sets[0], "float32", setting, out)
        results["sweep"].append({**raw.offline_run(run), "asked": setting})

    def fastest(system: str) -> dict:
        return max((r for r in results["sweep"] if r["system"] == system), key=throughput)

    for index, budget in enumerate([0, *map(int, args.budgets.split(","))]):
        for system in (SYSTEMS if index % 2 == 0 else SYSTEMS[::-1]):
            sweep(system, {"token_budget": budget, "max_seqs": 0})
    for index, seqs in enumerate(map(int, args.max_seqs.split(","))):
        for system in (SYSTEMS if index % 2 == 0 else SYSTEMS[::-1]):
            sweep(system, {"token_budget": fastest(system)["token_budget"], "max_seqs": seqs})
    best = {system: {"token_budget": fastest(system)["token_budget"],
                     "max_seqs": fastest(system)["max_seqs"]} for system in SYSTEMS}
    results["best"] = best
    print(f"best settings: {best}")

    for dtype in args.dtypes.split(","):
        for round_index in range(args.rounds):
            print(f"offline {dtype} round {round_index + 1}/{args.rounds}")
            runs = {}
            for system in (SYSTEMS if round_index % 2 == 0 else SYSTEMS[::-1]):
                out = WORK_DIR / f"offline-{dtype}-{system}-{round_index}.json"
                runs[system] = raw.offline_run(run_offline(system, peer_python, model_dir, sets[0],
                                                           dtype, best[system], out))
            results["offline"].append({"dtype": dtype, "round": round_index, "runs": runs})
            raw.save(results, results_path)
            if dtype == "float32":
                check_identical(f"offline round {round_index + 1}",
                                runs["baton"]["token_digests"], runs["vllm"]["token_digests"])

    print("reference: baton's engine in fp32 over every set")
    from baton.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    reference = []
    for index, workload in enumerate(sets):
        run = run_offline("baton", peer_python, model_dir, workload, "float32", best["baton"],
                          WORK_DIR / f"reference-{index}.json")
        reference.append([raw.digest(tokenizer.decode(ids)) for ids in run["token_ids"]])
    results["reference_text_digests"] = reference

    slower_rps = min(statistics.median(args.requests / r["runs"][s]["wall_s"]
                                       for r in results["offline"] if r["dtype"] == "float32")
                     for s in SYSTEMS)
    rates = tuple(round(fraction * slower_rps, 1) for fraction in RATE_FRACTIONS)
    plan = list(zip(scenarios(rates), sets, strict=True))
    results["scenarios"] = [{"name": s.name, "max_concurrency": s.max_concurrency,
                             "request_rate": s.request_rate, "set": i, "describe": s.describe()}
                            for i, (s, _) in enumerate(plan)]
    text_plan = [(scenario, Workload.load(workload).save_texts(workload.with_suffix(".prompts.jsonl")))
                 for scenario, workload in plan]
    for dtype in filter(None, args.served_dtypes.split(",")):
        for round_index in range(args.served_rounds):
            print(f"served {dtype} round {round_index + 1}/{args.served_rounds}")
            for system in (SYSTEMS if round_index % 2 == 0 else SYSTEMS[::-1]):
                out = WORK_DIR / f"served-{dtype}-{system}-{round_index}.json"
                served = run_served(system, peer_python, model_dir, sets[0], dtype, best[system],
                                    text_plan, out)
                record = {"dtype": dtype, "round": round_index, "system": system,
                          "setting": best[system], "load_s": round(served["load_s"], 1),
                          "scenarios": {name: raw.served_run(run)
                                        for name, run in served["clients"].items()}}
                results["served"].append(record)
                raw.save(results, results_path)
                for index, (scenario, _) in enumerate(plan):
                    run = record["scenarios"][scenario.name]
                    if run["errors"] or run["completed"] != args.requests:
                        raise RuntimeError(f"{system} {scenario.name}: {run['completed']} of "
                                           f"{args.requests} completed; {run['errors']}")
                    if dtype == "float32":
                        check_identical(f"{system} served {scenario.name} round {round_index + 1}",
                                        reference[index], run["text_digests"])
    results["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results["load_average_end"] = os.getloadavg()
    raw.save(results, results_path)
    if results_path == raw.RESULTS_PATH:
        write_report("peer.md", render(raw.load()))
    else:
        (WORK_DIR / "quick-peer.md").write_text(render(raw.load(results_path)))
        print(f"wrote {WORK_DIR / 'quick-peer.md'} (a quick check, not a figure)")


if __name__ == "__main__":
    main()
