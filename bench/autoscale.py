"""Autoscaling on one machine: does `baton up --autoscale` follow a load ramp up and down,
and does a decode pod it removes cost any client a token?

    python bench/autoscale.py            # the full run (15-20 min on 2 cores): writes
                                         # docs/benchmarks/autoscale-results.json.gz and
                                         # autoscale.md
    python bench/autoscale.py --short    # a check of the harness (< 3 min), into --out
    python bench/autoscale.py --render   # autoscale.md again from the committed JSON alone

One `baton up --autoscale` (no chain, 1 to 2 decode pods, loopback only) takes an
open-loop Poisson load through its OpenAI API that steps up and back down (``PHASES``).
Every request is a streamed greedy completion with KV compression off and a fixed length
(``ignore_eos``), its token ids returned (``return_token_ids``). Meanwhile the HTTP API's
/metrics is read every second: the live decode pods and the planner's target. The
supervisor's printed decisions give the moments it scaled.

Afterwards, with the service stopped, the shipped model in this process (baton's engine,
the pods' dtype) generates every prompt once: the fault-free reference. A stream that
differs from it lost tokens (fewer after their common prefix) or repeated some (more).
A decode pod being retired gets ``--decode-grace-s`` for its streams, shorter than the
longest ones, so scale-downs also move streams (the gateway replays the tokens sent).

The report is rendered from the raw results alone (``render``): per-phase TTFT and ITL
P90 against the targets, pods over time, every scale event with the streams in flight,
and lost / repeated tokens.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent / "peer"))
from common import REPORT_DIR, markdown_table, report_header, run_record
from results import load, save  # the peer benchmark's: byte-stable gzipped JSON

ROOT = Path(__file__).resolve().parents[1]
RESULTS_NAME = "autoscale-results.json.gz"
REPORT_NAME = "autoscale.md"


@dataclass(frozen=True)
class Setup:
    """One run's load and planner settings (the short check shrinks the time scales)."""

    phases: tuple[tuple[float, float], ...]  # (requests per second, seconds), in order
    interval_s: float
    window_s: float
    scale_up_cooldown_s: float
    scale_down_cooldown_s: float
    bin_s: float  # the report's time step
    ttft_p90_s: float = 2.0
    itl_p90_s: float = 0.04
    min_decode_pods: int = 1
    max_decode_pods: int = 2
    decode_grace_s: float = 1.0
    prompt_tokens: tuple[int, int] = (16, 64)
    output_tokens: tuple[int, int] = (32, 96)
    max_in_flight: int = 64  # an arrival waits while this many streams are open
    seed: int = 0

    def flags(self) -> list[str]:
        return ["--autoscale", "--chain-ranks", "0",
                "--min-decode-pods", str(self.min_decode_pods),
                "--max-decode-pods", str(self.max_decode_pods),
                "--ttft-p90-s", str(self.ttft_p90_s), "--itl-p90-s", str(self.itl_p90_s),
                "--interval-s", str(self.interval_s), "--window-s", str(self.window_s),
                "--scale-up-cooldown-s", str(self.scale_up_cooldown_s),
                "--scale-down-cooldown-s", str(self.scale_down_cooldown_s),
                "--decode-grace-s", str(self.decode_grace_s)]


# Two climbs past what one pod streams within the ITL target on 2 cores (30 ms: one pod
# holds ITL P90 near 20 ms at 5 requests/s, and its fitted line says it carries fewer
# sequences than the climbs bring), each coming down in steps, so that a pod is retired
# at a load one pod carries: streams still run on both.
FULL = Setup(phases=((0.5, 45), (2.0, 45), (5.0, 75), (2.0, 75), (1.0, 60), (5.0, 60),
                     (2.0, 75), (0.5, 45), (0.0, 45)),
             interval_s=5.0, window_s=30.0, scale_up_cooldown_s=15.0,
             scale_down_cooldown_s=30.0, bin_s=15.0, output_tokens=(32, 112), itl_p90_s=0.03)
SHORT = Setup(phases=((0.5, 8), (5.0, 25), (1.5, 35)), interval_s=2.0, window_s=8.0,
              scale_up_cooldown_s=4.0, scale_down_cooldown_s=8.0, bin_s=5.0,
              output_tokens=(24, 96))
START_TIMEOUT_S = 240.0
STREAM_TIMEOUT_S = 180.0
SAMPLE_S = 1.0  # /metrics is read this often
STOP_TIMEOUT_S = 60.0
SCALE_EVENT = re.compile(r"autoscaler: decode pods (\d+) -> (\d+) \((starting|draining) ([^)]*)\)")


@dataclass
class Stream:
    index: int
    start_s: float  # since the load began
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    end_s: float = math.nan
    error: str = ""
    moved: bool = False  # the gateway moved it to another decode pod (route reason)


# --- running it -----------------------------------------------------------------------------

class BatonUp:
    """`baton up --autoscale` as a child process; its printed lines, timestamped."""

    def __init__(self, setup: Setup, http_port: int, log_path: Path,
                 planner_trace: Path | None = None) -> None:
        command = [sys.executable, "-m", "baton.cli", "up", *setup.flags(),
                   "--listen", "127.0.0.1:0", "--http-port", str(http_port)]
        if planner_trace is not None:
            command += ["--planner-trace", str(planner_trace.resolve())]
        self.base_url = f"http://127.0.0.1:{http_port}"
        self.lines: list[tuple[float, str]] = []
        self.serving = False
        self._started_or_ended = threading.Event()
        self.log = log_path.open("w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, cwd=ROOT)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._started_or_ended.wait(START_TIMEOUT_S)
        if not self.serving:
            self.stop()
            raise RuntimeError(f"baton up did not start; its output is in {log_path}")

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))
            self.log.write(line)
            self.log.flush()
            if line.startswith("serving;"):
                self.serving = True
                self._started_or_ended.set()
        self._started_or_ended.set()  # it exited

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(10)
        self.log.close()


def read_metrics(base_url: str):
    from baton.planner import parse_pod

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as response:
        return parse_pod("gateway", "gateway", response.read().decode())


class Sampler:
    """The live decode pods and the planner's targets, every ``SAMPLE_S``."""

    def __init__(self, base_url: str, origin_s: float) -> None:
        self.base_url, self.origin_s = base_url, origin_s
        self.samples: list[list[float]] = []  # [t, live decode, target decode, target prefill]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                metrics = read_metrics(self.base_url)
            except OSError:
                continue
            if metrics.has("baton_replicas"):
                self.samples.append([round(time.monotonic() - self.origin_s, 2),
                                     metrics.value("baton_replicas", role="decode"),
                                     metrics.value("baton_planner_target_replicas", role="decode"),
                                     metrics.value("baton_planner_target_replicas", role="prefill")])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def make_streams(setup: Setup, tokenizer) -> list[Stream]:
    """Poisson arrivals through the phases; prompts cut from the standard library's source."""
    rng = random.Random(setup.seed)
    source = tokenizer.encode(inspect.getsource(json.decoder) + inspect.getsource(json.encoder))
    streams, phase_start_s = [], 0.0
    for rate, seconds in setup.phases:
        t = phase_start_s
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= phase_start_s + seconds:
                break
            length = rng.randint(*setup.prompt_tokens)
            offset = rng.randrange(0, len(source) - length)
            streams.append(Stream(len(streams), t, source[offset: offset + length],
                                  rng.randint(*setup.output_tokens)))
        phase_start_s += seconds
    return streams


def run_stream(api: openai.OpenAI, model: str, stream: Stream, origin_s: float) -> None:
    try:
        for chunk in api.completions.create(
                model=model, prompt=stream.prompt, max_tokens=stream.max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"return_token_ids": True, "ignore_eos": True,
                            "compression": {"enabled": False}}):
            now_s = time.monotonic() - origin_s
            for choice in chunk.choices:
                token_ids = choice.model_extra.get("token_ids") or []
                if token_ids:
                    stream.tokens += token_ids
                    stream.times_s.append(now_s)
            route = ((chunk.model_extra or {}).get("baton") or {}).get("route") or {}
            stream.moved = stream.moved or "moved to" in route.get("reason", "")
    except Exception as e:  # noqa: BLE001 - counted as a lost request in the results
        stream.error = f"{type(e).__name__}: {e}"[:200]
    stream.end_s = time.monotonic() - origin_s


def drive(base_url: str, streams: list[Stream], setup: Setup, origin_s: float) -> None:
    """Send each stream at its time (open loop, at most ``max_in_flight`` open)."""
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                        timeout=STREAM_TIMEOUT_S)
    model = api.models.list().data[0].id
    slots = threading.BoundedSemaphore(setup.max_in_flight)
    threads = []

    def one(stream: Stream) -> None:
        try:
            run_stream(api, model, stream, origin_s)
        finally:
            slots.release()

    for stream in streams:
        time.sleep(max(0.0, stream.start_s - (time.monotonic() - origin_s)))
        if not slots.acquire(timeout=STREAM_TIMEOUT_S):
            stream.error = "the client's in-flight limit stayed full"
            continue
        thread = threading.Thread(target=one, args=(stream,), daemon=True)
        thread.start()
        threads.append(thread)
    deadline = time.monotonic() + STREAM_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for stream in streams:
        if math.isnan(stream.end_s) and not stream.error:
            stream.error = f"not ended {STREAM_TIMEOUT_S:g} s after the last one was sent"


def reference_tokens(streams: list[Stream]) -> list[list[int]]:
    """Every prompt generated once by the shipped model in this process: the fault-free run."""
    from baton.model.hub import SHIPPED_MODEL_DIR
    from baton.model.loader import load_checkpoint
    from baton.sampling.params import SamplingParams
    from baton.sarathi.engine import Engine

    loaded = load_checkpoint(SHIPPED_MODEL_DIR, dtype="auto", device="cpu")  # the pods' dtype
    engine = Engine(loaded.model, loaded.tokenizer)
    params = [SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True)
              for s in streams]
    return [result.token_ids for result in engine.generate([s.prompt for s in streams], params)]


def run(setup: Setup, log_path: Path, planner_trace: Path | None = None) -> dict:
    from baton.model.hub import SHIPPED_MODEL_DIR
    from baton.model.loader import load_checkpoint
    from baton.serving import free_port

    tokenizer = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cpu").tokenizer
    streams = make_streams(setup, tokenizer)
    record = run_record()
    began_s = time.monotonic()
    baton = BatonUp(setup, free_port(), log_path, planner_trace)
    try:
        origin_s = time.monotonic()
        sampler = Sampler(baton.base_url, origin_s)
        drive(baton.base_url, streams, setup, origin_s)
        # until the phases' time is over: the last ones may send nothing (pods come down)
        time.sleep(max(0.0, sum(seconds for _, seconds in setup.phases)
                       - (time.monotonic() - origin_s)))
        sampler.stop()
        migrations = read_metrics(baton.base_url).value("baton_gateway_migrations_total")
    finally:
        baton.stop()
    load_done_s = time.monotonic()
    events = [[round(t - origin_s, 2), *match.groups()] for t, line in baton.lines
              if (match := SCALE_EVENT.search(line))]
    reference = reference_tokens(streams)
    durations = {"start_s": origin_s - began_s, "load_s": load_done_s - origin_s,
                 "reference_s": time.monotonic() - load_done_s}
    return {"run": record, "setup": asdict(setup),
            "command": "baton up " + " ".join(setup.flags()),
            "durations_s": {name: round(value, 1) for name, value in durations.items()},
            "samples": sampler.samples, "scale_events": events,
            "gateway_migrations": migrations,
            "streams": [record(stream, want) for stream, want in zip(streams, reference)]}


def record(stream: Stream, reference: list[int]) -> dict:
    """One stream, compactly: times in ms, its token gaps, and how it compares."""
    common = 0
    for got, want in zip(stream.tokens, reference):
        if got != want:
            break
        common += 1
    gaps = [round((b - a) * 1000) for a, b in zip(stream.times_s, stream.times_s[1:])]
    end_ms = round(stream.end_s * 1000) if math.isfinite(stream.end_s) else None
    return {"start_ms": round(stream.start_s * 1000), "end_ms": end_ms,
            "prompt_tokens": len(stream.prompt), "max_tokens": stream.max_tokens,
            "ttft_ms": round((stream.times_s[0] - stream.start_s) * 1000) if stream.times_s else None,
            "gaps_ms": gaps, "tokens": len(stream.tokens), "identical": stream.tokens == reference,
            "lost": len(reference) - common, "repeated": len(stream.tokens) - common,
            "moved": stream.moved, "error": stream.error}


# --- the report -----------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def _phase_rows(results: dict) -> list[list[object]]:
    setup, rows, start_s = results["setup"], [], 0.0
    for rate, seconds in setup["phases"]:
        inside = [s for s in results["streams"] if start_s <= s["start_ms"] / 1000 < start_s + seconds]
        ttfts = [s["ttft_ms"] for s in inside if s["ttft_ms"] is not None]
        gaps = [gap for s in inside for gap in s["gaps_ms"]]
        pods = [live for t, live, _, _ in results["samples"] if start_s <= t < start_s + seconds]
        rows.append([f"{start_s:.0f}-{start_s + seconds:.0f} s", f"{rate:g}", len(inside),
                     f"{min(pods):.0f}-{max(pods):.0f}" if pods else "-",
                     _ms(percentile(ttfts, 0.9)), _ms(percentile(gaps, 0.9))])
        start_s += seconds
    return rows


def _timeline_rows(results: dict) -> list[list[object]]:
    bin_s, rows = results["setup"]["bin_s"], []
    end_s = max([t for t, *_ in results["samples"]] + [0.0])
    for index in range(math.ceil(end_s / bin_s)):
        low, high = index * bin_s, (index + 1) * bin_s
        samples = [sample for sample in results["samples"] if low <= sample[0] < high]
        started = [s for s in results["streams"] if low <= s["start_ms"] / 1000 < high]
        gaps = [gap for s in results["streams"] for gap, t in _gap_times(s) if low <= t < high]
        rows.append([f"{low:.0f}", len(started),
                     "-" if not samples else f"{samples[-1][1]:.0f}",
                     "-" if not samples else f"{samples[-1][2]:.0f}",
                     _ms(percentile([s["ttft_ms"] for s in started if s["ttft_ms"] is not None], 0.9)),
                     _ms(percentile(gaps, 0.9))])
    return rows


def _gap_times(stream: dict):
    """(gap ms, second at which it ended), from the first token on (approximate: the gaps
    are laid end to end after the first token)."""
    t = (stream["start_ms"] + (stream["ttft_ms"] or 0)) / 1000
    for gap in stream["gaps_ms"]:
        t += gap / 1000
        yield gap, t


def _in_flight(results: dict, t: float) -> list[dict]:
    """The streams started and not yet ended at ``t`` s."""
    return [s for s in results["streams"]
            if s["start_ms"] / 1000 <= t < (s["end_ms"] or math.inf) / 1000]


def _event_rows(results: dict) -> list[list[object]]:
    rows = []
    for t, before, after, verb, pods in results["scale_events"]:
        in_flight = _in_flight(results, t)
        rows.append([f"{t:.0f}", f"{before} -> {after}", f"{verb} {pods}", len(in_flight),
                     sum(not s["identical"] for s in in_flight)])
    return rows


def render(results: dict) -> str:
    setup, streams = results["setup"], results["streams"]
    phases = ", then ".join(f"{rate:g}/s for {seconds:g} s" for rate, seconds in setup["phases"])
    completed = [s for s in streams if not s["error"]]
    downs = [e for e in results["scale_events"] if e[3] == "draining"]
    ups = [e for e in results["scale_events"] if e[3] == "starting"]
    summary = markdown_table(["", ""], [
        ["requests sent / completed", f"{len(streams)} / {len(completed)}"],
        ["scale-ups / scale-downs", f"{len(ups)} / {len(downs)}"],
        ["streams in flight at a scale-down", f"{sum(len(_in_flight(results, e[0])) for e in downs)}"],
        ["streams moved to another pod (gateway migrations)",
         f"{sum(s['moved'] for s in streams)} ({results['gateway_migrations']:.0f})"],
        ["streams identical to the fault-free reference", f"{sum(s['identical'] for s in streams)}"],
        ["tokens lost (failed requests included)", f"{sum(s['lost'] for s in streams)}"],
        ["tokens repeated", f"{sum(s['repeated'] for s in streams)}"]])
    return "\n\n".join([
        report_header("Autoscaling on one machine", "bench/autoscale.py", "autoscale", results).rstrip(),
        ("Does `baton up --autoscale` follow a load ramp up and down within its targets, and "
         "does a decode pod it removes cost any client a token?"),
        (f"It took {results['durations_s']['start_s']:.0f} s to start, "
         f"{results['durations_s']['load_s']:.0f} s of load (and stopping), "
         f"{results['durations_s']['reference_s']:.0f} s for the reference."),
        (f"Service: `{results['command']}` (loopback only). Load: open-loop Poisson arrivals "
        f"through the OpenAI API: {phases}; prompts "
        f"of {setup['prompt_tokens'][0]}-{setup['prompt_tokens'][1]} tokens cut from the "
        f"standard library's source, {setup['output_tokens'][0]}-{setup['output_tokens'][1]} "
        f"greedy tokens each (`ignore_eos`), KV compression off. Targets: TTFT P90 "
        f"{setup['ttft_p90_s']} s, ITL P90 {setup['itl_p90_s']} s (client-side below: the "
        f"gateway's histograms are what the planner reads). A retired pod gets "
        f"{setup['decode_grace_s']} s for its streams; the rest are moved by token replay."),
        "## Summary",
        summary,
        ("Lost and repeated tokens compare each stream's token ids with the same prompt "
        "generated greedily by the shipped model in the benchmark process after the run "
        "(baton's engine, the pods' dtype, no fault): tokens after the common prefix that "
        "the reference has and the stream lacks are lost, those the stream has beyond it "
        "repeated (or wrong)."),
        "## By phase",
        markdown_table(["time", "requests/s", "requests", "decode pods", "TTFT P90 ms",
                        "ITL P90 ms"], _phase_rows(results)),
        "## Pods over time",
        (f"Per {setup['bin_s']:g} s: requests started, decode pods live and the planner's "
        f"target at the bin's end (the HTTP API's `baton_replicas` and "
        f"`baton_planner_target_replicas`), TTFT P90 of the requests started, ITL P90 of the "
        f"token gaps that ended in it."),
        markdown_table(["from s", "requests", "decode pods", "target", "TTFT P90 ms",
                        "ITL P90 ms"], _timeline_rows(results)),
        "## Scale events",
        ("As the supervisor printed them; streams in flight at that moment and how many of "
        "those differ from the reference."),
        markdown_table(["at s", "decode pods", "action", "streams in flight", "differing"],
                       _event_rows(results)) if results["scale_events"] else "None.",
    ]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true",
                        help="a short check of the harness (under 3 minutes); results to --out")
    parser.add_argument("--render", action="store_true",
                        help="only render the report from the raw results (the committed ones; with "
                             "--short, those in --out)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/baton-autoscale"),
                        help="where --short writes its JSON, report and baton up's output")
    parser.add_argument("--planner-trace", type=Path, default=None,
                        help="also record the planner's every step there (baton up's "
                             "--planner-trace): the recorded traces its tests replay")
    args = parser.parse_args()
    out = args.out if args.short else REPORT_DIR
    if args.render:
        (out / REPORT_NAME).write_text(render(load(out / RESULTS_NAME)))
        print(f"wrote {out / REPORT_NAME}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    log_path = (args.out if args.short else Path("/tmp")) / "autoscale-baton-up.log"
    results = run(SHORT if args.short else FULL, log_path, args.planner_trace)
    save(results, out / RESULTS_NAME)
    (out / REPORT_NAME).write_text(render(load(out / RESULTS_NAME)))  # from the raw results alone
    print(f"wrote {out / RESULTS_NAME} and {out / REPORT_NAME} (baton up's output: {log_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
