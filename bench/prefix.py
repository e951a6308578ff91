"""The prefix cache and cache-aware routing on ``baton up`` with 2 decode pods and a chain.

One question: where prompts repeat, how much do the decode pods' prefix caches and the
gateway's cache-aware routing take off the time to first token, and how close does the
routing come to an oracle that knows every pod's cache?

Two workloads, greedy, compression off (every hit usable), fp32, 2 decode pods and a
2-rank chain (``--no-chain-break-even``: prompts of 512 tokens and more may take it):

* **multi-turn chat**: 16 users, each holding 6 conversations of 4-8 turns one after
  another (96 conversations, ~580 requests); all 16 start at once. A conversation's first
  prompt is a 200-300-token context and a question of 20-50 tokens, each later turn
  resends the history (every prompt and answer so far) plus a new question of 20-50
  tokens; 32 new tokens a turn (the last turn stays within the shipped model's 1,024
  tokens); a user sends a turn when the previous one has ended.
* **shared system prompt**: one 700-token system prompt, 64 questions of 40-140 tokens
  after it, 8 requests in flight at a time; 32 new tokens each.

Three configurations, each a fresh cluster: cache-aware routing (the default), least-loaded
routing with the caches on, and least-loaded with the caches off
(``--kv-prefix-cache false``). Every configuration must produce the same tokens.

Hit rate: prompt tokens the decode pods took from their caches (``usage``) over all prompt
tokens. The oracle: for each request, the longest prefix (in whole 16-token blocks, its
last token excluded) it shares with what some pod had computed or was computing when it
was sent — the prompts of the requests sent before it (a pod shares a prompt's blocks as
its chunks complete) and the prompts and answers of those that had finished — as a router
that knows every pod's cache and sends each request to the right pod would find it at
best (no eviction: the pools are far from full here).

Raw results: docs/benchmarks/prefix-results.json.gz; the report, docs/benchmarks/prefix.md,
is rendered from that file alone (``--render``).

usage: python bench/prefix.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import sysconfig
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.api.requests import CompressionParams, GenerateRequest
from baton.client import BatonClient
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.tokenizer import Tokenizer
from baton.sampling.params import SamplingParams
from common import load_results, report_header, run_record, save_results, write_report

BLOCK = 16  # the decode pods' KV block size (kv.block_size's default)
NEW_TOKENS = 32
SEED = 2026
CONFIGS = {
    "cache-aware": {},
    "least-loaded": {"gateway": ["--gateway-policy", "least-loaded"]},
    "cache off": {"gateway": ["--gateway-policy", "least-loaded"],
                  "decode": ["--kv-prefix-cache", "false"]},
}
GOAL_TTFT_P90 = 3.0  # chat: cache off / cache-aware
GOAL_ORACLE = 0.9  # cache-aware hit rate / the oracle's


# --- workloads --------------------------------------------------------------------------------


class Texts:
    """Pieces of the standard library's source, tokenized (every machine has them)."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))

    def cut(self, low: int, high: int) -> list[int]:
        length = self.rng.randint(low, high)
        while True:
            ids = self.tokenizer.encode(self.rng.choice(self.sources).read_text(errors="replace"))
            if len(ids) >= length:
                start = self.rng.randint(0, len(ids) - length)
                return ids[start:start + length]


CHAT_USERS = 16
CHAT_CONVERSATIONS = 96


def chat_conversations(texts: Texts, count: int = CHAT_CONVERSATIONS) -> list[dict]:
    """Each: its opening context and the questions of its later turns (token ids)."""
    return [{"opening": texts.cut(200, 300) + texts.cut(20, 50),
             "questions": [texts.cut(20, 50) for _ in range(texts.rng.randint(3, 7))]}
            for _ in range(count)]


def system_prompt_requests(texts: Texts, count: int = 64) -> list[list[int]]:
    system = texts.cut(700, 700)
    return [system + texts.cut(40, 140) for _ in range(count)]


# --- one run ------------------------------------------------------------------------------------


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


class Log:
    """Every request of a run: when it was sent, its first token and its end (seconds from the
    run's start), its prompt and answer, its route and what its pod had cached."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.start_s = time.perf_counter()

    def send(self, client: BatonClient, workload: str, prompt: list[int]) -> list[int]:
        entry = {"workload": workload, "sent_s": time.perf_counter() - self.start_s,
                 "prompt": list(prompt)}  # a copy: a conversation's history grows on
        request = GenerateRequest(token_ids=tuple(prompt), sampling=greedy(),
                                  compression=CompressionParams(enabled=False))
        tokens: list[int] = []
        last = None
        for step in client.stream(request, timeout_s=600):
            if step.token_ids and not tokens:
                entry["first_s"] = time.perf_counter() - self.start_s
            tokens += step.token_ids
            last = step if step.finish_reason is not None else last
        entry.update(done_s=time.perf_counter() - self.start_s, answer=tokens,
                     cached=last.usage.cached_prompt_tokens, path="chain" if last.route.chain_id else "local",
                     reason=last.route.reason, pod=last.route.decode_address)
        with self.lock:
            self.requests.append(entry)
        return tokens


def in_threads(target, args_list: list[tuple]) -> None:
    """``target(*args)`` for each args in its own thread; raises the first failure after all end
    (a request that fails makes the run fail: every configuration must serve every request)."""
    failures: list[BaseException] = []

    def run(*args) -> None:
        try:
            target(*args)
        except BaseException as error:  # noqa: BLE001 - re-raised below, in the caller's thread
            failures.append(error)

    threads = [threading.Thread(target=run, args=args) for args in args_list]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(threads)} clients failed") from failures[0]


def in_workers(work: list, do, workers: int) -> None:
    """``do(item)`` for every item of ``work``, in its order, by ``workers`` threads that each
    take the next item when their last one has ended."""
    queue = list(work)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                item = queue.pop(0)
            do(item)

    in_threads(worker, [()] * workers)


def run_chat(client: BatonClient, log: Log, conversations: list[dict]) -> None:
    def converse(conversation: dict) -> None:
        history = list(conversation["opening"])
        history += log.send(client, "chat", history)
        for question in conversation["questions"]:
            history += question
            history += log.send(client, "chat", history)

    in_workers(conversations, converse, CHAT_USERS)


def run_system_prompt(client: BatonClient, log: Log, prompts: list[list[int]], in_flight: int = 8) -> None:
    in_workers(prompts, lambda prompt: log.send(client, "system", prompt), in_flight)


def run_config(name: str, conversations: list[dict], system_prompts: list[list[int]]) -> dict:
    os.environ["BATON_MODEL_DTYPE"] = "float32"
    spec = ClusterSpec(decode_workers=2, chain_ranks=2, chain_break_even=False,
                       prefill_threshold_tokens=512, extra_args=CONFIGS[name])
    with LocalCluster(spec) as cluster:
        client = BatonClient(cluster.gateway_address)
        client.wait_until_serving(120)
        warm = Texts(Tokenizer.from_dir(SHIPPED_MODEL_DIR), seed=1).cut(600, 600)  # not in the workloads
        for prompt in (warm, warm[:40]):
            client.generate(GenerateRequest(token_ids=tuple(prompt), sampling=greedy(),
                                            compression=CompressionParams(enabled=False)))
        results = {}
        for workload, run in (("chat", lambda log: run_chat(client, log, conversations)),
                              ("system", lambda log: run_system_prompt(client, log, system_prompts))):
            log = Log()
            run(log)
            results[workload] = {"wall_s": time.perf_counter() - log.start_s, "requests": log.requests}
        client.close()
    return results


# --- the oracle ---------------------------------------------------------------------------------


def common_blocks(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count // BLOCK * BLOCK


def oracle_hits(requests: list[dict]) -> list[int]:
    """Per request (in ``requests``' order), the cached prefix an all-knowing router finds."""
    hits = []
    for request in requests:
        limit = (len(request["prompt"]) - 1) // BLOCK * BLOCK
        computed = [other["prompt"] for other in requests
                    if other is not request and other["sent_s"] < request["sent_s"]]
        computed += [other["prompt"] + other["answer"] for other in requests
                     if other is not request and other["done_s"] <= request["sent_s"]]
        hits.append(min(limit, max((common_blocks(request["prompt"], seen) for seen in computed), default=0)))
    return hits


# --- results ------------------------------------------------------------------------------------


def compact(runs: list[dict]) -> dict:
    """What the report needs of every request (prompts and answers as lengths and digests)."""
    import hashlib

    def digest(tokens: list[int]) -> str:
        return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:16]

    out = []
    for run in runs:
        entry = {"config": run["config"], "round": run["round"]}
        for workload in ("chat", "system"):
            requests = sorted(run[workload]["requests"], key=lambda r: r["sent_s"])
            oracle = oracle_hits(requests)
            entry[workload] = {"wall_s": round(run[workload]["wall_s"], 3), "requests": [
                {"prompt_tokens": len(r["prompt"]), "prompt": digest(r["prompt"]),
                 "answer": digest(r["answer"]), "new_tokens": len(r["answer"]),
                 "ttft_ms": round((r["first_s"] - r["sent_s"]) * 1000, 1), "cached": r["cached"],
                 "oracle": o, "path": r["path"], "reason": r["reason"], "pod": r["pod"]}
                for r, o in zip(requests, oracle)]}
        out.append(entry)
    return out


def measure(rounds: int) -> dict:
    record = run_record()  # the machine (its load average included) as the run starts
    tokenizer = Tokenizer.from_dir(SHIPPED_MODEL_DIR)
    texts = Texts(tokenizer, SEED)
    conversations, system_prompts = chat_conversations(texts), system_prompt_requests(texts)
    runs = []
    for index in range(rounds):
        order = list(CONFIGS) if index % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            print(f"round {index + 1}/{rounds}: {name}", flush=True)
            runs.append({"config": name, "round": index + 1, **run_config(name, conversations, system_prompts)})
    return {"run": record, "load_average_end": round(os.getloadavg()[0], 1), "runs": compact(runs)}


# --- the report (from the raw results alone) ----------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(workload: dict) -> dict:
    requests = workload["requests"]
    ttfts = [r["ttft_ms"] for r in requests]
    prompt_tokens = sum(r["prompt_tokens"] for r in requests)
    return {"p50": percentile(ttfts, 0.5), "p90": percentile(ttfts, 0.9),
            "tok_s": sum(r["new_tokens"] for r in requests) / workload["wall_s"],
            "hit": sum(r["cached"] for r in requests) / prompt_tokens,
            "oracle": sum(r["oracle"] for r in requests) / prompt_tokens,
            "chain": sum(r["path"] == "chain" for r in requests),
            "cached_local": sum(r["path"] == "local" and r["cached"] > 0 for r in requests),
            "count": len(requests)}


def render(results: dict) -> str:
    runs = results["runs"]
    rounds = max(run["round"] for run in runs)
    lines = [report_header("Prefix cache and cache-aware routing", "bench/prefix.py", "prefix",
                           results, f"python bench/prefix.py --rounds {rounds}"),
             f"Load average {results['load_average_end']:.1f} at the end.", "",
             ("`baton up` with 2 decode pods and a 2-rank chain (chain for prompts of 512 tokens "
             "and more, break-even off), fp32, compression off, greedy, 32 new tokens a request. "
             "Each configuration a fresh cluster, the order flipping every round. See the "
             "script's docstring for the workloads and the oracle."), ""]
    for workload, title in (("chat", (f"Multi-turn chat ({CHAT_USERS} users, {CHAT_CONVERSATIONS} "
                                       "conversations of 4-8 turns)")),
                            ("system", "Shared system prompt (64 questions, 8 in flight)")):
        lines += [f"## {title}", "",
                  ("| configuration | round | TTFT P50 | TTFT P90 | tok/s | hit rate | oracle | "
                  "of the oracle | chain / cached-local / all |"), "|---|---|---|---|---|---|---|---|---|"]
        for run in runs:
            s = summary(run[workload])
            share = f"{s['hit'] / s['oracle']:.0%}" if s["oracle"] else "-"
            lines.append(f"| {run['config']} | {run['round']} | {s['p50']:,.0f} ms | {s['p90']:,.0f} ms | "
                         f"{s['tok_s']:,.0f} | {s['hit']:.0%} | {s['oracle']:.0%} | {share} | "
                         f"{s['chain']} / {s['cached_local']} / {s['count']} |")
        lines.append("")
    lines += goals(runs)
    lines += chat_tail(runs)
    lines += decisions(runs)
    return "\n".join(lines) + "\n"


def goals(runs: list[dict]) -> list[str]:
    by = {}
    for run in runs:
        by.setdefault(run["config"], []).append(run)
    ratios = [summary(off["chat"])["p90"] / summary(aware["chat"])["p90"]
              for aware, off in zip(by["cache-aware"], by["cache off"])]
    shares = [summary(run["chat"])["hit"] / summary(run["chat"])["oracle"] for run in by["cache-aware"]]
    shares += [summary(run["system"])["hit"] / summary(run["system"])["oracle"] for run in by["cache-aware"]]
    def answers(run: dict) -> set[tuple[str, str]]:
        return {(r["prompt"], r["answer"]) for workload in ("chat", "system")
                for r in run[workload]["requests"]}

    same = all(answers(run) == answers(runs[0]) for run in runs[1:])
    return ["## Goals", "",
            (f"* Multi-turn chat, TTFT P90 with the caches off / with cache-aware routing: "
            f"{', '.join(f'{r:.1f}x' for r in ratios)} (goal >= {GOAL_TTFT_P90:.0f}x: "
            f"{'met' if min(ratios) >= GOAL_TTFT_P90 else 'missed'})."),
            (f"* Cache-aware hit rate as a share of the oracle's (chat and system prompt, every round): "
            f"{', '.join(f'{s:.0%}' for s in shares)} (goal >= {GOAL_ORACLE:.0%}: "
            f"{'met' if min(shares) >= GOAL_ORACLE else 'missed'})."),
            f"* Every configuration gave the same answers: {'yes' if same else 'NO'}.", ""]


def chat_tail(runs: list[dict]) -> list[str]:
    """The chat's TTFT split by what a request could reuse: first turns (nothing computed before
    shares a block with them, the oracle's 0) are the same work in every configuration."""
    lines = ["## Where the chat's TTFT comes from", "",
             ("| configuration | round | first turns (nothing to reuse) | their TTFT P50 / P90 | "
              "requests with a hit | their TTFT P50 / P90 | the rest: TTFT P50 / P90 |"),
             "|---|---|---|---|---|---|---|"]

    def p50_p90(requests: list[dict]) -> str:
        ttfts = [r["ttft_ms"] for r in requests]
        return f"{percentile(ttfts, 0.5):,.0f} / {percentile(ttfts, 0.9):,.0f} ms" if ttfts else "-"

    for run in runs:
        requests = run["chat"]["requests"]
        first = [r for r in requests if r["oracle"] == 0]
        hit = [r for r in requests if r["oracle"] > 0 and r["cached"] > 0]
        rest = [r for r in requests if r["oracle"] > 0 and r["cached"] == 0]
        lines.append(f"| {run['config']} | {run['round']} | {len(first) / len(requests):.0%} | "
                     f"{p50_p90(first)} | {len(hit) / len(requests):.0%} | {p50_p90(hit)} | "
                     f"{p50_p90(rest)} |")
    return lines + [""]


def decisions(runs: list[dict]) -> list[str]:
    """The cache-or-chain decisions of the first cache-aware run, as the reasons say."""
    run = next(run for run in runs if run["config"] == "cache-aware")
    kinds: dict[str, int] = {}
    for workload in ("chat", "system"):
        for request in run[workload]["requests"]:
            reason = request["reason"]
            if request["path"] == "chain":
                kind = "chain: uncached tokens >= the threshold"
            elif "cached on" in reason and "uncached tokens <" in reason:
                kind = "the pod holding the prefix: the uncached rest < the threshold"
            elif "cached on" in reason:
                kind = "the pod holding the prefix (short prompt)"
            else:
                kind = "no cached prefix: prefilled on a decode pod"
            kinds[kind] = kinds.get(kind, 0) + 1
    return ["## Decisions (cache-aware, round 1)", "", "| decision | requests |", "|---|---|",
            *[f"| {kind} | {count} |" for kind, count in sorted(kinds.items())], ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--render", "--report-only", dest="render", action="store_true",
                        help="render the report again from the committed raw results")
    args = parser.parse_args()
    if not args.render:
        save_results("prefix", measure(args.rounds))
    write_report("prefix.md", render(load_results("prefix")))


if __name__ == "__main__":
    main()
