"""The peer benchmark's report: every round, medians, per-round ratios, TTFT, token agreement,
and the throughput plot (docs/benchmarks/peer.md, peer.png)."""

from __future__ import annotations

import statistics
from pathlib import Path

from common import markdown_table

SYSTEMS = ("vllm", "baton")
OWN_ENGINES = "own_engines"  # a served round's key for each system's offline engine run


def throughput(run: dict) -> float:
    return run["generated_tokens"] / run["wall_s"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def agreement(rounds: list[dict]) -> tuple[int, int, int]:
    """(requests whose greedy tokens are identical, requests, first differing position's
    median among the others) over every round."""
    same = total = 0
    first_diffs = []
    for runs in rounds:
        for ours, theirs in zip(runs["baton"]["token_ids"], runs["vllm"]["token_ids"], strict=True):
            total += 1
            if ours == theirs:
                same += 1
            else:
                first_diffs.append(next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b))
    return same, total, int(statistics.median(first_diffs)) if first_diffs else -1


def render(results: dict, served: dict, description: str, rounds: int, load_average) -> str:
    lines = ["# baton against vLLM", "",
             f"Machine: {description}; load average {load_average[0]:.1f} at the end.", "",
             ("Same workload for both: `bench/peer_workload.py` (prompts of 50-900 tokens cut from "
             "the standard library with a fixed seed, 64 new tokens each, greedy, end-of-sequence "
             "ignored; 64 requests on the shipped model, the first 32 on the ~100M random "
             "checkpoint), all submitted at once. vLLM 0.32.0 (CPU build, its own virtualenv, "
             "`LLMEngine` step loop, its defaults: torch.compile, 4096-token batches, 2 OpenMP "
             "threads bound to cores 0-1); baton's `Engine.step` loop with the service's "
             "defaults (auto token budget). Fresh processes, 2 threads each, interleaved: every "
             "round runs both systems back to back per row, the order flipping each round; each "
             "run waits for a quiet machine and records the CPU time other processes used while "
             "it was timed. TTFT counts from submission."), "",
             "## Offline batch: medians", ""]
    rows = []
    for (model, dtype), rounds_of_pair in results.items():
        ratios = [throughput(r["baton"]) / throughput(r["vllm"]) for r in rounds_of_pair]
        medians = {s: statistics.median(throughput(r[s]) for r in rounds_of_pair) for s in SYSTEMS}
        ttft50 = {s: statistics.median(statistics.median(r[s]["ttft_s"]) for r in rounds_of_pair)
                  for s in SYSTEMS}
        ttft99 = {s: statistics.median(percentile(r[s]["ttft_s"], 0.99) for r in rounds_of_pair)
                  for s in SYSTEMS}
        same, total, first = agreement(rounds_of_pair)
        rows.append([model, dtype, f"{medians['vllm']:.0f}", f"{medians['baton']:.0f}",
                     f"**{statistics.median(ratios):.2f}x**",
                     f"{ttft50['vllm']:.2f} / {ttft99['vllm']:.2f}",
                     f"{ttft50['baton']:.2f} / {ttft99['baton']:.2f}",
                     f"{ttft50['baton'] / ttft50['vllm']:.2f}x",
                     f"{same}/{total}" + (f" (first difference at token {first})" if first >= 0 else "")])
    lines.append(markdown_table(
        ["model", "dtype", "vLLM tok/s", "baton tok/s", "baton / vLLM (median of rounds)",
         "vLLM TTFT P50 / P99 s", "baton TTFT P50 / P99 s", "TTFT P50 baton / vLLM",
         "identical greedy requests"], rows))
    lines += ["", "## Offline batch: every round", ""]
    rows = []
    for (model, dtype), rounds_of_pair in results.items():
        for index, runs in enumerate(rounds_of_pair):
            rows.append([model, dtype, index + 1,
                         f"{throughput(runs['vllm']):.0f}", f"{throughput(runs['baton']):.0f}",
                         f"{throughput(runs['baton']) / throughput(runs['vllm']):.2f}x",
                         f"{statistics.median(runs['vllm']['ttft_s']):.2f}",
                         f"{statistics.median(runs['baton']['ttft_s']):.2f}",
                         runs["baton"].get("token_budget", ""),
                         f"{runs['vllm']['others_cpu_s']:.2f} / {runs['baton']['others_cpu_s']:.2f}"])
    lines.append(markdown_table(
        ["model", "dtype", "round", "vLLM tok/s", "baton tok/s", "ratio", "vLLM TTFT P50 s",
         "baton TTFT P50 s", "baton budget", "others' CPU s (vLLM / baton)"], rows))
    lines += ["", "![generated tokens/s](peer.png)", "",
              ("Where baton's time goes on this workload, and what closing the gap needs: "
               "[docs/runtime.md](../runtime.md)."), ""]
    if served:
        lines += served_section(results, served)
    return "\n".join(lines) + "\n"


SERVED_NAMES = {"vllm": "`vllm serve`",
                "baton-up": ("`baton up` (defaults: the decode pod on every core, a 2-rank chain "
                             "of 1 thread per rank for prompts >= 512 tokens that reach its measured "
                             "break-even, here none)"),
                "baton-up-2t": "`baton up --threads 2 --chain-ranks 0`",
                "baton-up-pyramid": ("`baton up` with every default, KV compression on "
                                     "(not the same work)")}
# Rows that compute something else than vLLM (PyramidInfer prunes the caches, the tokens
# differ): shown for what a user's defaults serve, left out of the goals.
NOT_THE_SAME_WORK = {"baton-up-pyramid"}


SERVED_CLIENTS = {"http": "threads, HTTP", "vllm-bench": "`vllm bench serve`",
                  "grpc": "threads, gRPC", "grpc-aio": "asyncio, gRPC"}


def served_section(results: dict, served: dict) -> list[str]:
    lines = ["## Served", "",
             ("The shipped model, both servers over the OpenAI HTTP API (`/v1/completions`, SSE) "
              "and driven by the same clients (`bench/peer_served.py`), 64 streaming requests "
              "sent at once, KV compression off except in the row that says so (its "
              "*vs its own engine* is against the compression-off engine). *threads, HTTP*: 64 client threads, prompts as "
              "token ids; *`vllm bench serve`*: vLLM's own benchmark client (asyncio), the same "
              "prompts as text, `--request-rate inf --max-concurrency 64`; *threads, gRPC*: "
              "baton's own API (the same threads sharing one `BatonClient`), for what the HTTP "
              "door costs; *asyncio, gRPC*: baton's API from one event loop (a task per request on "
              "one `AsyncBatonClient`). Throughput is generated tokens over "
              "the time to the last token; each server is started once per round and driven by "
              "every client in turn (the order rotates). *vs its own engine*: each server's "
              "throughput over its own offline engine's median (same dtype), what its serving "
              "stack keeps of its engine; "
              + ("the engines run in the same rounds, right before the servers, so both figures "
                 "come from the same hour."
                 if all(OWN_ENGINES in r for rounds in served.values() for r in rounds)
                 else "the engine's figure is the offline median above (another run).")), ""]
    rows, verdicts = [], []
    for dtype, rounds_of_dtype in served.items():
        engines = own_engines(rounds_of_dtype, results.get(("shipped", dtype), []))
        for client, client_label in SERVED_CLIENTS.items():
            peer_client = "http" if client.startswith("grpc") else client
            for name, label in SERVED_NAMES.items():
                if name not in rounds_of_dtype[0] or client not in rounds_of_dtype[0][name]["clients"]:
                    continue  # a client this server does not speak, or a run without this setup
                runs = [r[name]["clients"][client] for r in rounds_of_dtype]
                values = [throughput(run) for run in runs]
                ttft = statistics.median(statistics.median(run["ttft_s"]) for run in runs)
                ttft99 = statistics.median(percentile(run["ttft_s"], 0.99) for run in runs)
                errors = sum(len(run["errors"]) for run in runs)
                ratios = [throughput(r[name]["clients"][client])
                          / throughput(r["vllm"]["clients"][peer_client]) for r in rounds_of_dtype]
                engine = engines["vllm" if name == "vllm" else "baton"]
                if name != "vllm" and name not in NOT_THE_SAME_WORK:
                    verdicts.append((statistics.median(ratios), statistics.median(values) / engine,
                                     f"{dtype}, {client_label}, {label}"))
                rows.append([dtype, client_label, label, f"{statistics.median(values):.0f}",
                             " / ".join(f"{v:.0f}" for v in values),
                             f"{statistics.median(ratios):.2f}x",
                             f"{statistics.median(values) / engine:.2f}x",
                             f"{ttft:.2f} / {ttft99:.2f}", errors])
    lines.append(markdown_table(["dtype", "client", "server", "tok/s (median)", "every round",
                                 "vs vllm serve (same client)", "vs its own engine",
                                 "TTFT P50 / P99 s", "errors"], rows))
    lines += ["", "The gRPC rows are compared with `vllm serve` under the threaded HTTP client. "
              + served_goals(verdicts)
              + " Where the served time goes is in [runtime.md](../runtime.md), \"Served\"."]
    return lines + [""] + served_cpu_section(served)


# Where a served run's CPU went, by process role (peer_timing.ROLES): a server's front door
# and the process that runs its model; the client is this benchmark's threads.
FRONT_DOORS = ("gateway", "vLLM API server")
ENGINE_PROCESSES = ("decode pod", "vLLM engine core")


def per_token_us(runs: list[dict], counted) -> float:
    """Median over ``runs`` of the CPU per generated token (µs) of the roles ``counted(role)``."""
    return statistics.median(
        sum(seconds for role, seconds in run["cpu_by_role_s"].items() if counted(role)) * 1e6
        / run["generated_tokens"] for run in runs)


def served_cpu_section(served: dict) -> list[str]:
    """CPU per generated token by process for the threaded clients (medians over rounds), next
    to the same engine's offline figure: on a machine the client shares, what the serving
    stack spends is taken from the engine."""
    rows = []
    served_roles = ("client", *FRONT_DOORS, *ENGINE_PROCESSES)
    for dtype, rounds_of_dtype in served.items():
        engine_runs = [r[OWN_ENGINES] for r in rounds_of_dtype if OWN_ENGINES in r]
        for client in ("http", "grpc", "grpc-aio"):  # vllm bench serve's window holds its start-up
            for name, label in SERVED_NAMES.items():
                if name not in rounds_of_dtype[0] or client not in rounds_of_dtype[0][name]["clients"]:
                    continue
                runs = [r[name]["clients"][client] for r in rounds_of_dtype]
                if not all("cpu_by_role_s" in run for run in runs):
                    continue  # results of a run before the breakdown was recorded
                engines = [e["vllm" if name == "vllm" else "baton"] for e in engine_runs]
                offline = statistics.median(e["own_cpu_s"] * 1e6 / e["generated_tokens"]
                                            for e in engines) if engines else float("nan")
                cores = statistics.median(sum(run["cpu_by_role_s"].values()) / run["wall_s"]
                                          for run in runs)
                rows.append([dtype, SERVED_CLIENTS[client], label,
                             f"{per_token_us(runs, lambda role: role == 'client'):.0f}",
                             f"{per_token_us(runs, lambda role: role in FRONT_DOORS):.0f}",
                             f"{per_token_us(runs, lambda role: role in ENGINE_PROCESSES):.0f}",
                             f"{per_token_us(runs, lambda role: role not in served_roles):.0f}",
                             f"{per_token_us(runs, lambda role: True):.0f}", f"{offline:.0f}",
                             f"{cores:.2f}"])
    if not rows:
        return []
    return ["### Served: CPU per generated token", "",
            ("Each process's CPU time (`/proc`, 10 ms ticks) over the timed part of the runs of "
             "every client but `vllm bench serve` (whose process starts inside its window), per generated token, medians over rounds. *front door*: baton's gateway "
             "or vLLM's API server; *model process*: baton's decode pod or vLLM's engine core; "
             "*the rest*: redis, a chain, anything else the server started. *its engine offline*: "
             "the same engine's whole process in this round's offline run. *busy cores*: all of "
             "it over the run's wall time (the machine has 2). With every process on the same 2 "
             "cores, the model process's figure above its offline one is its own serving work (its "
             "RPC loop, streaming its outputs) and what it lost to the others (its OpenMP threads "
             "preempted, or spinning for a preempted partner), and "
             "serving at 0.9x of the engine leaves the client, the front door and the rest about "
             "a ninth of the engine's CPU per token."), "",
            markdown_table(["dtype", "client", "server", "client µs", "front door µs",
                            "model process µs", "the rest µs", "all µs",
                            "its engine offline µs", "busy cores"], rows), ""]


def own_engines(rounds_of_dtype: list[dict], offline: list[dict]) -> dict[str, float]:
    """Each system's median engine throughput for the served rounds: the engine runs of those
    rounds, or (results of a run before they were made) the offline rounds'."""
    runs = [r[OWN_ENGINES] for r in rounds_of_dtype if OWN_ENGINES in r] or offline
    return {system: statistics.median(throughput(r[system]) for r in runs) if runs else float("nan")
            for system in SYSTEMS}


def served_goals(verdicts: list[tuple[float, float, str]]) -> str:
    """One sentence per served goal: how many `baton up` rows meet it, and the rows that miss
    it with their ratios (``verdicts``: vs `vllm serve`, vs baton's engine, the row)."""
    sentences = []
    for index, (goal, against) in enumerate(((1.0, "`vllm serve`"), (0.9, "baton's engine"))):
        missed = [v for v in verdicts if v[index] < goal]
        sentence = (f"Goal at least {goal:.1f}x {against}: met by {len(verdicts) - len(missed)} "
                    f"of the {len(verdicts)} `baton up` rows")
        if missed and len(missed) < len(verdicts):
            sentence += "; missed by " + "; ".join(f"{v[2]} ({v[index]:.2f}x)" for v in missed)
        elif missed:
            best = max(verdicts, key=lambda v: v[index])
            sentence += f"; the best is {best[index]:.2f}x ({best[2]})"
        sentences.append(sentence + ".")
    return " ".join(sentences)


def plot_throughput(results: dict, path: Path) -> None:
    """Left: generated tokens/s per row (median bar, every round a dot), log scale so that both
    models read; right: baton / vLLM per round, with parity and the 1.3x goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{model}\n{dtype}" for model, dtype in results]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.38
    for offset, system in ((-width / 2, "vllm"), (width / 2, "baton")):
        medians = [statistics.median(throughput(r[system]) for r in rounds) for rounds in results.values()]
        bars = left.bar([i + offset for i in range(len(labels))], medians, width, label=system)
        left.bar_label(bars, fmt="%.0f", fontsize=8)
        for i, rounds in enumerate(results.values()):  # every round as a dot
            left.scatter([i + offset] * len(rounds), [throughput(r[system]) for r in rounds],
                         color="black", s=8, zorder=3)
    left.set_yscale("log")
    left.set_xticks(range(len(labels)), labels)
    left.set_ylabel("generated tokens/s (2 threads, log scale)")
    left.set_title("offline batch, same workload")
    left.legend()
    highest_ratio = 0.0
    for i, rounds in enumerate(results.values()):
        ratios = [throughput(r["baton"]) / throughput(r["vllm"]) for r in rounds]
        highest_ratio = max(highest_ratio, *ratios)
        right.scatter([i] * len(ratios), ratios, color="tab:orange", s=18, zorder=3)
        right.plot([i - 0.2, i + 0.2], [statistics.median(ratios)] * 2, color="tab:orange")
    right.axhline(1.0, color="gray", linewidth=1, label="parity")
    right.axhline(1.3, color="tab:green", linestyle="--", linewidth=1, label="goal 1.3x")
    right.set_xticks(range(len(labels)), labels)
    right.set_ylim(0, max(1.5, highest_ratio * 1.1))  # every round's dot in view
    right.set_ylabel("baton / vLLM tokens/s, per round")
    right.set_title("ratio (line: median of rounds)")
    right.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")
