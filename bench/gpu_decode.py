"""Decode on a GPU: steps replayed from CUDA graphs against eager ones, the batch-1 step
against the memory-bandwidth bound, greedy tokens against transformers, and KV between the
device and host memory against the PCIe bound.

Writes docs/benchmarks/decode-gpu.md and decode-gpu-results.json.gz. The model is a
~1.2B-parameter Llama (Llama 3.2 1B's shape) with random weights, made here in Hugging
Face's format in bfloat16; both runtimes load it from that directory.

    python bench/gpu_decode.py                        # on a CUDA machine (make gpu-check)
    python bench/gpu_decode.py --render               # the report again, from the results
    python bench/gpu_decode.py --device cpu --smoke   # the script itself, on a tiny model
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.config import KVPoolConfig, SchedulerConfig
from baton.kv import DenseKV, KVPool, LayerKV
from baton.kv.decode_step import DecodeGroup, DecodeStep
from baton.model import CausalLM, load_checkpoint, prefill, save_checkpoint
from baton.model.attention import attend_decode_batch, decode_attention_bias
from baton.model.config import ModelConfig
from baton.model.forward_batch import read_in_place
from baton.model.presets import PRESETS, random_model
from baton.model.probe import fastest_run_s
from baton.sampling.params import SamplingParams
from baton.sarathi import Engine
from baton.sarathi.decode_graphs import DecodeGraphs
from baton.sarathi.request import Sequence
from baton.sarathi.runner import ModelRunner
from baton.sarathi.scheduler import PrefillChunk, SchedulerOutput
from baton.transfer.codec import CHUNK_BYTES
from baton.transfer.device_copy import HostCopy, layers_to_host, to_device, to_host
from baton.transfer.received import ReceivedLayer, joined
from common import (
    load_results,
    markdown_table,
    report_header,
    run_record,
    save_results,
    write_report,
)

CONFIG_SMOKE = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, max_position_embeddings=1024,
                           rope={"rope_type": "default", "rope_theta": 10000.0})

BATCHES = (1, 8, 32, 64)
PROMPT = 128  # tokens per sequence before the timed decode steps
STEPS = 32  # decode steps timed per round
ROUNDS = 5  # rounds per batch, eager and graphed alternating, after a warm-up round each
BLOCK_SIZE = 16
GREEDY_PROMPTS = 4  # prompts of PROMPT random tokens, GREEDY_TOKENS generated each
GREEDY_TOKENS = 32
FLOOR_ULPS = 4  # a flip between two logits this close (in bf16 units of the largest) is rounding
COPY_BYTES = 1 << 30  # the PCIe and device-copy yardsticks move 1 GiB
KV_TOKENS = 8192  # the prompt whose KV goes off and onto the device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn, device: torch.device) -> float:
    """The fastest of 5 runs of ``fn`` after one warm-up, the device drained around each."""
    return fastest_run_s(fn, runs=5, warmup=1, device=device)


# --- the model -------------------------------------------------------------------------------


def make_checkpoint(config: ModelConfig, directory: Path, device: torch.device) -> int:
    """Random weights drawn on ``device``, saved in Hugging Face's layout in bfloat16; returns
    the parameter count."""
    model = random_model(config, dtype=torch.bfloat16, device=device, draw_on_device=True)
    save_checkpoint(model, directory, dtype=torch.bfloat16)
    count = sum(parameter.numel() for parameter in model.parameters())
    del model
    return count


# --- decode steps: graphs against eager ------------------------------------------------------


def decode_round(model, pool: KVPool, runner: ModelRunner, batch: int, generator) -> float:
    """Prefill ``batch`` fresh prompts, then time STEPS decode-only iterations (each ends with
    its greedy tokens on the host, as the engine's do); returns seconds per step."""
    seqs = start_sequences(model, pool, runner, batch, generator)
    synchronize(model.device)
    start = time.perf_counter()
    decode_iterations(runner, seqs, STEPS)
    return (time.perf_counter() - start) / STEPS


def start_sequences(model, pool: KVPool, runner: ModelRunner, batch: int, generator) -> list[Sequence]:
    """``batch`` fresh prompts of PROMPT random tokens prefilled in an emptied pool, each with
    its first token."""
    for seq_id in pool.sequence_ids():
        pool.free(seq_id)
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=STEPS + 1, ignore_eos=True)
    seqs = [Sequence(f"s{index}", torch.randint(0, vocab, (PROMPT,), generator=generator).tolist(),
                     params, arrival=index, sampler=None, decoder=None, stop_matcher=None)
            for index in range(batch)]
    _, logits = runner.execute(SchedulerOutput(prefills=[PrefillChunk(seq, PROMPT) for seq in seqs]))
    for seq, row in zip(seqs, logits.pick([])[0], strict=True):
        seq.num_computed = PROMPT
        seq.output_ids.append(row)
    return seqs


def decode_iterations(runner: ModelRunner, seqs: list[Sequence], steps: int) -> None:
    """``steps`` decode-only iterations of ``seqs``, greedy tokens to the host after each."""
    for _ in range(steps):
        sampled, logits = runner.execute(SchedulerOutput(decodes=seqs))
        for seq, token in zip(sampled, logits.pick([])[0], strict=True):
            seq.num_computed += 1
            seq.output_ids.append(token)


# Eager steps gather each sequence's blocks into padded tensors; replayed ones gather them too
# or read them in place through FlexAttention (baton.kernels.flex_decode), which only a
# replayed step uses (its compiled call's host cost is hidden there alone).
MODES = {"eager": (False, False), "graphs": (True, False), "graphs_flex": (True, True)}


@contextlib.contextmanager
def flex_decode(on: bool):
    previous = os.environ.get("BATON_FLEX_DECODE")
    os.environ["BATON_FLEX_DECODE"] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("BATON_FLEX_DECODE")
        else:
            os.environ["BATON_FLEX_DECODE"] = previous


def decode_steps(model) -> list[dict]:
    """Seconds per decode step at each batch in every mode (``MODES``), alternating by round."""
    config, device = model.config, model.device
    rows = []
    for batch in BATCHES:
        blocks = config.num_hidden_layers * batch * ((PROMPT + STEPS) // BLOCK_SIZE + 2) + 1
        runs: dict[str, list[float]] = {mode: [] for mode in MODES}
        runners = {}
        for mode, (graphed, _) in MODES.items():
            pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                          BLOCK_SIZE, blocks, model.dtype, device)
            graphs = DecodeGraphs(model, pool) if graphed else None
            runners[mode] = (pool, ModelRunner(model, pool, graphs), graphs)
        generator = torch.Generator().manual_seed(batch)
        for round_index in range(ROUNDS + 1):  # round 0 warms up (and captures the graphs)
            for mode, (pool, runner, _) in runners.items():
                with flex_decode(MODES[mode][1]):
                    step_s = decode_round(model, pool, runner, batch, generator)
                if round_index:
                    runs[mode].append(step_s)
        row = {"batch": batch, **{f"{mode}_s": runs[mode] for mode in MODES}}
        for mode in ("graphs", "graphs_flex"):
            graphs = runners[mode][2]
            row.update({f"{mode}_captured": graphs.num_graphs, f"{mode}_enabled": graphs.enabled,
                        f"{mode}_replayed": graphs.replayed_steps, f"{mode}_failure": graphs.failure})
            if graphs.capture and graphs.num_graphs:
                # the replay alone: the step's kernels, without the runner's host work around it
                graph = max(graphs._graphs.items(), key=lambda item: item[0][1])[1]
                with flex_decode(MODES[mode][1]):
                    row[f"{mode}_replay_s"] = seconds(graph.replay, device)
        rows.append(row)
        print(f"[decode] batch {batch}: " + ", ".join(
            f"{mode} {min(runs[mode]) * 1e3:.2f} ms" for mode in MODES), flush=True)
    return rows


# --- decode attention alone: gathered against read in place ----------------------------------


ATTENTION_CONTEXTS = (512, 4096)


def attention_reads(model) -> list[dict]:
    """One layer's decode attention over a random paged cache, each row's blocks scattered
    over one pool (sized for the largest case: one pool, one kernel per batch): gathered into
    padded tensors and attended (``DecodeStep.read``, then SDPA) against FlexAttention reading
    the blocks in place; seconds each, and their largest difference."""
    config, device, dtype = model.config, model.device, model.dtype
    generator = torch.Generator(device=device).manual_seed(11)
    num_blocks = max(BATCHES) * -(-max(ATTENTION_CONTEXTS) // BLOCK_SIZE) + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                          device=device, dtype=dtype, generator=generator)
    v_cache = torch.randn_like(k_cache)
    step = DecodeStep(torch.zeros(1, 1, dtype=torch.long, device=device), [], k_cache, v_cache,
                      torch.zeros(num_blocks, BLOCK_SIZE, dtype=torch.long, device=device))
    rows = []
    for context in ATTENTION_CONTEXTS:
        for batch in BATCHES:
            row = attention_read(step, config.num_attention_heads, context, batch, generator)
            rows.append(row)
            print(f"[attention] context {context} batch {batch}: gathered "
                  f"{row['gathered_s'] * 1e6:.0f} us, in place {row['in_place_s'] * 1e6:.0f} us, "
                  f"max|diff| {row['max_difference']:.1e}", flush=True)
    return rows


def attention_read(step: DecodeStep, heads: int, context: int, batch: int,
                   generator: torch.Generator) -> dict:
    k_cache = step.k_cache
    device, dtype = k_cache.device, k_cache.dtype
    _, _, kv_heads, head_dim = k_cache.shape
    width = -(-context // BLOCK_SIZE)
    order = torch.randperm(k_cache.shape[0] - 1, device=device, generator=generator) + 1
    blocks = order[:batch * width].view(batch, width)
    lengths = torch.linspace(context // 2, context, batch, device=device).long()  # ragged
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype, generator=generator)
    group = DecodeGroup(slice(0, batch), [blocks], lengths[None], uniform=True)

    def gathered():
        k, v, _, count = step.read(group, 0, with_positions=False)
        return attend_decode_batch(q, k, v, decode_attention_bias(None, None, count, k.shape[1],
                                                                  None, dtype))

    def in_place():
        return read_in_place(q, step, blocks, lengths)

    with flex_decode(True):
        difference = float((gathered().float() - in_place().float()).abs().max())
        return {"context": context, "batch": batch, "gathered_s": replayed_seconds(gathered, device),
                "in_place_s": replayed_seconds(in_place, device), "max_difference": difference,
                "kv_bytes": int(lengths.sum()) * 2 * kv_heads * head_dim * k_cache.element_size()}


def replayed_seconds(fn, device: torch.device) -> float:
    """``fn``'s device time: on CUDA captured into a graph and its replay timed, so the launches'
    host cost (which a decode step's graph hides) stays out; elsewhere ``seconds(fn)``."""
    if device.type != "cuda":
        return seconds(fn, device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return seconds(graph.replay, device)


def device_copy_bandwidth(device: torch.device) -> dict:
    """The memory-bandwidth yardsticks, bytes per second: a 1 GiB device-to-device copy counting
    the bytes read and written, and a sum over 1 GiB (bytes read alone)."""
    source = torch.rand(COPY_BYTES // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    return {"copy": 2 * COPY_BYTES / seconds(lambda: target.copy_(source), device),
            "read": COPY_BYTES / seconds(lambda: source.sum(), device)}


# --- greedy tokens against transformers ----------------------------------------------------------


def greedy_against_transformers(directory: Path, ours: CausalLM) -> dict:
    """Greedy tokens of the engine (decode steps replayed) against transformers' generate()
    in bfloat16; where they part, how far apart transformers itself puts the two tokens."""
    import transformers

    device = ours.device
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.bfloat16).to(device).eval()
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, ours.config.vocab_size, (PROMPT,), generator=generator).tolist()
               for _ in range(GREEDY_PROMPTS)]
    engine = Engine(ours, None, scheduler=SchedulerConfig(token_budget=512, max_running=8),
                    kv=KVPoolConfig(block_size=BLOCK_SIZE, num_blocks=4096))
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    results = engine.generate(prompts, params)
    graphs = engine.runner.graphs
    cases = []
    for prompt, result in zip(prompts, results, strict=True):
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=GREEDY_TOKENS,
                                          min_new_tokens=GREEDY_TOKENS, do_sample=False,
                                          pad_token_id=0)[0, len(prompt):].tolist()
            # transformers' own logits along our tokens: at each step, how far below its best
            # our choice lies (0 where they agree), in bf16 units of its largest logit
            forced = torch.tensor([prompt + result.token_ids[:-1]], device=device)
            logits = reference(forced).logits[0, len(prompt) - 1:].float()
        chosen = logits.gather(1, torch.tensor(result.token_ids, device=device)[:, None])[:, 0]
        best = logits.max(-1).values
        ulp = torch.finfo(torch.bfloat16).eps * logits.abs().max(-1).values
        gaps = ((best - chosen) / ulp).tolist()
        same = next((i for i, (a, b) in enumerate(zip(result.token_ids, expected)) if a != b),
                    len(expected))
        cases.append({"ours": result.token_ids, "theirs": expected, "same_prefix": same,
                      "gap_ulps": gaps})
    del reference
    return {"cases": cases, "graphs_replayed": 0 if graphs is None else graphs.replayed_steps}


# --- KV off and onto the device ----------------------------------------------------------------


def pcie(device: torch.device) -> dict:
    """Host <-> device copies of 1 GiB: from and to pinned memory (the PCIe bound), and from
    and to pageable memory for comparison; bytes per second."""
    on_device = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    rates = {}
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=pinned and device.type == "cuda")
        rates[f"to_device_{kind}"] = COPY_BYTES / seconds(
            lambda host=host, pinned=pinned: on_device.copy_(host, non_blocking=pinned), device)
        rates[f"to_host_{kind}"] = COPY_BYTES / seconds(
            lambda host=host, pinned=pinned: host.copy_(on_device, non_blocking=pinned), device)
    return rates


class CopyingKV:
    """A prefill's cache that copies each finished layer off the device as the next one starts,
    as the chain's tail ships by layer (``copy(layer)`` -> something ``finish`` can wait on)."""

    def __init__(self, num_layers: int, copy) -> None:
        self.dense = DenseKV(num_layers)
        self.copy = copy
        self.copies = []

    def extend(self, layer: int, k, v, positions):
        if layer > 0:
            self.copies.append(self.copy(self.dense.layers[layer - 1]))
        return self.dense.extend(layer, k, v, positions)

    def finish(self) -> None:
        self.copies.append(self.copy(self.dense.layers[-1]))
        for copy in self.copies:
            if isinstance(copy, HostCopy):
                copy.wait()


def blocking_copy(layer: LayerKV) -> list[torch.Tensor]:
    """How a layer left the device before: ``.cpu()`` into pageable memory, stalling the stream."""
    return [layer.positions.cpu(), layer.k.cpu(), layer.v.cpu()]


def pinned_copy(layer: LayerKV) -> HostCopy:
    return to_host([layer.positions, layer.k, layer.v])


def as_received(layers: list[LayerKV]) -> list[ReceivedLayer]:
    """A host cache as a decode pod receives it: keys and values in the message pieces of a push (CHUNK_BYTES each)."""
    def pieces(tensor: torch.Tensor) -> tuple[memoryview, ...]:
        raw = memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())
        return tuple(raw[start:start + CHUNK_BYTES] for start in range(0, len(raw), CHUNK_BYTES))

    return [ReceivedLayer(layer.positions, pieces(layer.k), pieces(layer.v), layer.k.dtype,
                          layer.k.shape[1], layer.k.shape[2]) for layer in layers]


def kv_paths(model: CausalLM) -> dict:
    """A KV_TOKENS-token prompt's cache through the product's two paths. Off the device, as
    the chain's tail ships by layer: the prefill alone, then with each finished layer copied
    out as the next is computed (blocking into pageable memory, as before; pinned on the copy
    stream, as now). Onto the device, as a decode pod lands a pushed cache: from the message
    pieces into the pool, through pageable memory (``KVPool.store`` alone) and through pinned
    memory on the copy stream (``to_device``, then ``store``)."""
    config, device = model.config, model.device
    layers = config.num_hidden_layers
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (KV_TOKENS,), generator=generator).to(device)
    positions = torch.arange(KV_TOKENS, device=device)

    def prefill_copying(copy) -> None:
        kv = CopyingKV(layers, copy)
        prefill(model, ids, positions, kv)
        kv.finish()

    alone_s = seconds(lambda: prefill(model, ids, positions, DenseKV(layers)), device)
    blocking_s = seconds(lambda: prefill_copying(blocking_copy), device)
    pinned_s = seconds(lambda: prefill_copying(pinned_copy), device)
    cache = DenseKV(layers)
    prefill(model, ids, positions, cache)
    host = [LayerKV(x.k.cpu(), x.v.cpu(), x.positions.cpu()) for x in cache.complete_layers()]
    kv_bytes = sum(layer.k.nbytes + layer.v.nbytes for layer in host)
    received = as_received(host)
    pool = KVPool(layers, config.num_key_value_heads, config.head_dim, BLOCK_SIZE,
                  layers * (KV_TOKENS // BLOCK_SIZE + 1), model.dtype, device)

    pinned_host = layers_to_host(cache.complete_layers())

    on_gpu = device.type == "cuda"

    def join() -> None:  # the pieces into pinned memory alone, no device copy
        for layer in received:
            joined(layer.k_pieces, pin_memory=on_gpu), joined(layer.v_pieces, pin_memory=on_gpu)

    def onto_device() -> None:  # pinned host layers to the device, waited for
        to_device(pinned_host, device)
        synchronize(device)

    def store(staged: bool) -> None:
        pool.free("kv")
        # fresh layers each run: a device pool reads a received layer's ``k``/``v`` (joined
        # from its pieces, a cached_property), so a reused layer would skip the join
        layers_in = [dataclasses.replace(layer) for layer in received]
        pool.store("kv", to_device(layers_in, device) if staged else layers_in)

    return {"kv_bytes": kv_bytes, "prefill_s": alone_s, "prefill_blocking_copies_s": blocking_s,
            "prefill_pinned_copies_s": pinned_s,
            "to_host_s": seconds(lambda: layers_to_host(cache.complete_layers()), device),
            "to_device_s": seconds(onto_device, device), "join_s": seconds(join, device),
            "store_pageable_s": seconds(lambda: store(False), device),
            "store_pinned_s": seconds(lambda: store(True), device)}


# --- the report ------------------------------------------------------------------------------


SMOKE_SIZES = {"ROUNDS": 1, "STEPS": 4, "KV_TOKENS": 512, "GREEDY_TOKENS": 6, "GREEDY_PROMPTS": 2,
               "BATCHES": (1, 3), "ATTENTION_CONTEXTS": (64,), "COPY_BYTES": 1 << 24}


def measure(args) -> dict:
    device = torch.device(args.device)
    if args.smoke:
        globals().update(SMOKE_SIZES)
    config = CONFIG_SMOKE if args.smoke else PRESETS["random-1b"]
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch) / "random-1b"
        parameters = make_checkpoint(config, directory, device)
        print(f"[model] {parameters / 1e9:.2f}B parameters in {directory}", flush=True)
        model = load_checkpoint(directory, dtype="bfloat16", device=device.type,
                                with_tokenizer=False).model
        results = {"device": str(device), "parameters": parameters,
                   "config": model.config.to_hf_dict(), "smoke": args.smoke,
                   "weight_bytes": sum(p.nbytes for p in model.parameters()),
                   "copy_bandwidth": device_copy_bandwidth(device),
                   "decode": decode_steps(model), "attention": attention_reads(model)}
        results["greedy"] = greedy_against_transformers(directory, model)
        results["pcie"] = pcie(device)
        results["kv"] = kv_paths(model)
    return results


def report(results: dict) -> str:
    config = results["config"]
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    yardsticks = results["copy_bandwidth"]
    if not isinstance(yardsticks, dict):  # older results: bytes read by the copy alone
        yardsticks = {"copy": 2 * yardsticks}
    bandwidth = yardsticks["copy"]
    ms = 1e3
    rows = []
    for row in results["decode"]:
        eager = min(row["eager_s"])
        replayed = {mode: min(row[f"{mode}_s"]) for mode in ("graphs", "graphs_flex") if f"{mode}_s" in row}
        captured = "; ".join(
            str(row[f"{mode}_captured"]) if row.get(f"{mode}_enabled", True)
            else f"none: capture failed ({row.get(f'{mode}_failure')}), steps ran eagerly"
            for mode in replayed)
        best = min(replayed.values())
        rows.append([row["batch"], f"{eager * ms:.2f}",
                     *(f"{replayed[mode] * ms:.2f}" if mode in replayed else "-" for mode in ("graphs", "graphs_flex")),
                     *(f"{row[f'{mode}_replay_s'] * ms:.2f}" if f"{mode}_replay_s" in row else "-"
                       for mode in ("graphs", "graphs_flex")),
                     f"{eager / best:.2f}x", f"{row['batch'] / best:,.0f}", captured])
    attention_rows = [[row["context"], row["batch"], f"{row['gathered_s'] * 1e6:.0f}",
                       f"{row['in_place_s'] * 1e6:.0f}", f"{row['gathered_s'] / row['in_place_s']:.2f}x",
                       f"{row['kv_bytes'] / row['in_place_s'] / 1e9:.0f}", f"{row['max_difference']:.1e}"]
                      for row in results.get("attention", [])]
    batch1 = next(row for row in results["decode"] if row["batch"] == 1)
    # batch 1 reads every weight but the embedding table (one row of it) and its sequence's KV
    # (the prompt and, on average, half the timed steps) once per step
    embedding = 0 if config.get("tie_word_embeddings") else config["vocab_size"] * config["hidden_size"] * 2
    weights = results["weight_bytes"] - embedding
    kv_bytes = (PROMPT + STEPS // 2) * layers * 2 * kv_heads * head_dim * 2
    bound = (weights + kv_bytes) / bandwidth
    modes = [mode for mode in ("graphs", "graphs_flex") if f"{mode}_s" in batch1]
    step = min(min(batch1[f"{mode}_s"]) for mode in modes)
    replay = min((batch1[f"{mode}_replay_s"] for mode in modes if f"{mode}_replay_s" in batch1), default=None)
    goal = "met" if step <= 2 * bound else "not met"
    replay_text = ("" if replay is None else
                   f" The replay alone (the step's kernels, without the runner's host work around "
                   f"them) takes **{replay * ms:.2f} ms**, {replay / bound:.2f}x the bound; the rest "
                   f"of the step, {(step - replay) * ms:.2f} ms, is host work: claiming the step's "
                   "blocks, filling the graph's inputs, and the greedy tokens' copy to the host.")
    read_text = ("" if "read" not in yardsticks else
                 f" (a sum over 1 GiB, bytes read alone, runs at {yardsticks['read'] / 1e9:,.0f} GB/s)")
    greedy_rows = []
    for index, case in enumerate(results["greedy"]["cases"]):
        flips = [gap for gap in case["gap_ulps"] if gap > 0]
        greedy_rows.append([index, f"{case['same_prefix']} of {len(case['theirs'])}",
                            len(flips), f"{max(flips, default=0):.1f}"])
    worst = max((gap for case in results["greedy"]["cases"] for gap in case["gap_ulps"]), default=0)
    verdict = ("every step picks transformers' best token or one within "
               f"{FLOOR_ULPS} bf16 units of it" if worst <= FLOOR_ULPS else
               f"a step picks a token {worst:.1f} bf16 units below transformers' best: more than "
               "rounding explains")
    pcie_rates, kv = results["pcie"], results["kv"]
    gb = 1e9
    pcie_rows = [["device -> pinned host", f"{pcie_rates['to_host_pinned'] / gb:.1f}"],
                 ["pinned host -> device", f"{pcie_rates['to_device_pinned'] / gb:.1f}"],
                 ["device -> pageable host", f"{pcie_rates['to_host_pageable'] / gb:.1f}"],
                 ["pageable host -> device", f"{pcie_rates['to_device_pageable'] / gb:.1f}"]]
    off_rows = [["prefill alone", f"{kv['prefill_s'] * ms:.1f}", ""],
                ["each finished layer copied out with `.cpu()` (pageable, blocking)",
                 f"{kv['prefill_blocking_copies_s'] * ms:.1f}",
                 f"{(kv['prefill_blocking_copies_s'] - kv['prefill_s']) * ms:+.1f}"],
                ["each finished layer copied out with `to_host` (pinned, copy stream)",
                 f"{kv['prefill_pinned_copies_s'] * ms:.1f}",
                 f"{(kv['prefill_pinned_copies_s'] - kv['prefill_s']) * ms:+.1f}"]]
    on_rows = []
    for label, key, bound_key in (
            ("device -> pinned host (`layers_to_host`, the cache alone)", "to_host_s", "to_host_pinned"),
            ("pinned host -> device (`to_device` of host layers)", "to_device_s", "to_device_pinned"),
            ("the message pieces joined into pinned memory (host only)", "join_s", None),
            ("`KVPool.store` from the pieces (pageable)", "store_pageable_s", "to_device_pinned"),
            ("`to_device` then `KVPool.store` (pinned, copy stream)", "store_pinned_s", "to_device_pinned")):
        if key not in kv:
            continue
        rate = kv["kv_bytes"] / kv[key]
        on_rows.append([label, f"{kv[key] * ms:.1f}", f"{rate / gb:.1f}",
                        "" if bound_key is None else f"{rate / pcie_rates[bound_key]:.2f}"])
    label = "GPU run" if results["device"].startswith("cuda") else "CPU smoke run, not a figure"
    header = report_header("Decode on a GPU: CUDA graphs, the bandwidth bound, KV over PCIe",
                           "bench/gpu_decode.py", "decode-gpu", results)
    return f"""{header}
{label}, bfloat16. Model: {results['parameters'] / 1e9:.2f}B
parameters with random weights (Llama 3.2 1B's shape: {layers} layers, {kv_heads} KV heads of
{head_dim}, a {config['vocab_size']:,}-token vocabulary), made by `bench/gpu_decode.py` in
Hugging Face's format; both runtimes load it from there.

## Decode steps replayed from CUDA graphs

Each batch: {PROMPT}-token prompts, then {STEPS} decode-only iterations through the engine's
runner (logits to the host every step, as the engine samples them): eager, and replayed from
graphs with attention gathering each sequence's blocks into padded tensors or reading them in
place through FlexAttention, in alternating rounds ({ROUNDS} each after a warm-up round that
captures the graphs); the fastest round counts. "Replay alone" times the graph's replay by
itself (the step's device work). The speed-up is eager over the fastest replayed mode.

{markdown_table(["batch", "eager ms/step", "graphs, gathered ms/step", "graphs, in place ms/step",
                 "replay alone, gathered ms", "replay alone, in place ms", "speed-up",
                 "tokens/s, fastest", "graphs captured (gathered; in place)"], rows)}

## Decode attention: gathered against read in place

One layer's decode attention over a paged cache whose blocks lie scattered over the pool,
rows from half the context to all of it: gathered into padded tensors then attended
(`DecodeStep.read`, SDPA), against FlexAttention reading the blocks where they lie
(`baton.kernels.flex_decode`). Each is captured into a graph and its replay timed (fastest
of 5), so the figures are device time, as in a replayed step; and the largest difference of
the outputs.

{markdown_table(["context", "batch", "gathered us", "in place us", "speed-up",
                 "in place, GB/s of KV read", "max difference"], attention_rows)}

## Batch-1 decode against the memory-bandwidth bound

A batch-1 step reads every weight but the embedding table, and its sequence's KV, once:
{weights / gb:.2f} GB + {kv_bytes / 1e6:.1f} MB. Measured copy bandwidth: {bandwidth / gb:,.0f}
GB/s (1 GiB device-to-device copy, bytes read and written){read_text}. Bound: **{bound * ms:.2f}
ms**; the replayed step: **{step * ms:.2f} ms**, {step / bound:.2f}x the bound (goal: within 2x,
{goal}).{replay_text}

## Greedy tokens against transformers (bfloat16)

{GREEDY_PROMPTS} prompts of {PROMPT} random tokens, {GREEDY_TOKENS} greedy tokens each through
the engine (decode steps replayed: {results['greedy']['graphs_replayed']}), against
transformers' `generate()` on the same weights in bfloat16. Where the two part, transformers'
own logits along our tokens say how far below its best token ours lies, in units of bf16
rounding of its largest logit: {verdict}.

{markdown_table(["prompt", "tokens equal to transformers' (leading)", "steps where ours is not transformers' best",
                 "largest gap, bf16 units"], greedy_rows)}

## KV off and onto the device

PCIe, 1 GiB copies between the device and host memory, GB/s:

{markdown_table(["copy", "GB/s"], pcie_rows)}

Off the device, as the chain's tail ships by layer: a {KV_TOKENS}-token prefill
({kv['kv_bytes'] / 1e6:.0f} MB of KV) whose finished layers are copied to the host while the
next ones are computed, the last one after (fastest of 5 runs):

{markdown_table(["prefill", "ms", "over the prefill alone, ms"], off_rows)}

The same {kv['kv_bytes'] / 1e6:.0f} MB moved whole, and landed as a decode pod lands a pushed
cache (from the {CHUNK_BYTES >> 20} MiB message pieces it arrives in) into its pool:

{markdown_table(["path", "ms", "GB/s", "of the pinned PCIe rate"], on_rows)}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model and no report file: checks the script itself")
    parser.add_argument("--render", "--report-only", dest="render", action="store_true",
                        help="render the report again from the committed raw results")
    args = parser.parse_args(argv)
    if not args.render:
        if args.device == "cuda" and not torch.cuda.is_available():
            parser.error("no CUDA device here (--device cpu --smoke checks the script)")
        record = run_record([__file__, *(sys.argv[1:] if argv is None else argv)])
        results = {"run": record, **measure(args)}
        if args.smoke:
            print(report(results))
            return 0
        save_results("decode-gpu", results)
    write_report("decode-gpu.md", report(load_results("decode-gpu")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
