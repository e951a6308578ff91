"""The runtime, the SARATHI engine and a prefill chain on CUDA (skipped without a GPU).

fp32 on CUDA must meet the CPU tests' bar (1e-4 against transformers). In bf16
and fp16 the two runtimes do the same arithmetic in different kernels and
summation orders, so each lands at its own rounding distance from the fp32
result; there is no common exact answer to compare with. The bar is therefore
relative to transformers itself: our distance from the fp32 reference may be at
most twice transformers' distance at the same precision, or a floor of
``FLOOR_ULPS`` units of the dtype's rounding (eps * largest logit) when
transformers happens to land very close. A real defect (a swapped weight, RoPE
at the wrong position, a mask off by one) moves logits by O(1), two orders of
magnitude above either distance. Every measured distance is printed
(``pytest -s``) as a ``CUDA-EQUIVALENCE`` line for the benchmark notes.
"""

from __future__ import annotations

import pytest
import torch
from baton.config import KVPoolConfig, SchedulerConfig
from baton.kv import DenseKV, LayerKV
from baton.model import load_checkpoint, prefill, save_checkpoint
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.presets import random_model
from baton.runahead import LocalChain, ModelSource
from baton.sampling.params import SamplingParams
from baton.sarathi import Engine
from baton.sarathi.runner import StepLogits
from baton.transfer.device_copy import layers_to_host, to_device
from baton.transfer.received import ReceivedLayer
from hf_reference import (
    EQUIVALENCE_CASES,
    REDUCED_PRECISION_CASES,
    case_id,
    max_error,
    reference_logits,
    run_scenario,
    save_case,
    sequences,
    tiny_config,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FP32_TOLERANCE = 1e-4
LOW_PRECISION = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SLACK = 2.0
FLOOR_ULPS = 4
PROMPTS = [
    "import os\n\n\ndef read_file(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "def is_prime(n):\n    if n < 2:\n",
]


@pytest.fixture(scope="module", params=REDUCED_PRECISION_CASES, ids=case_id)
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param[0])
    hf_model = save_case(request.param, directory, seed=EQUIVALENCE_CASES.index(request.param))
    return case_id(request.param), directory, hf_model


def test_fp32_on_cuda_equals_transformers(checkpoint):
    case, directory, hf_model = checkpoint
    ours = load_checkpoint(directory, dtype="float32", device="cuda", with_tokenizer=False)
    ids = sequences(ours.config.vocab_size)
    error = max_error(run_scenario(ours, ids), reference_logits(hf_model, ids))
    print(f"CUDA-EQUIVALENCE {case} float32 ours={error:.2e} bar={FP32_TOLERANCE:.0e}")
    assert error < FP32_TOLERANCE


@pytest.mark.parametrize("dtype", sorted(LOW_PRECISION))
def test_low_precision_on_cuda_is_as_close_to_fp32_as_transformers(checkpoint, dtype):
    import transformers

    case, directory, hf_model = checkpoint
    ids = sequences(hf_model.config.vocab_size)
    truth = reference_logits(hf_model, ids)  # fp32 on CPU
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=LOW_PRECISION[dtype]).to("cuda").eval()
    theirs = max_error(reference_logits(theirs_model, ids), truth)
    ours_model = load_checkpoint(directory, dtype=dtype, device="cuda", with_tokenizer=False)
    ours = max_error(run_scenario(ours_model, ids), truth)
    scale = max(float(t.abs().max()) for t in truth)
    bar = max(SLACK * theirs, FLOOR_ULPS * torch.finfo(LOW_PRECISION[dtype]).eps * scale)
    print(f"CUDA-EQUIVALENCE {case} {dtype} ours={ours:.2e} transformers={theirs:.2e} "
          f"bar={bar:.2e} largest-logit={scale:.2f}")
    assert ours <= bar


def test_greedy_engine_on_cuda_equals_transformers_generate():
    # The shipped model through the SARATHI engine (paged KV, chunked prefills of the three
    # prompts batched together) in fp32 on CUDA, against generate() in fp32 on CUDA.
    import transformers

    shipped = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cuda")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        SHIPPED_MODEL_DIR, dtype=torch.float32).to("cuda").eval()
    engine = Engine(shipped.model, shipped.tokenizer,
                    scheduler=SchedulerConfig(token_budget=64, max_running=4),
                    kv=KVPoolConfig(block_size=16, num_blocks=256))
    results = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = torch.tensor([shipped.tokenizer.encode(prompt)], device="cuda")
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                          pad_token_id=shipped.config.eos_token_id)
        assert result.token_ids == expected[0, ids.shape[1]:].tolist(), prompt


@pytest.mark.parametrize("flex", ["1", "0"], ids=["in-place", "gathered"])
@pytest.mark.parametrize("policy", ["sarathi", "separate"])
def test_decode_steps_replayed_from_cuda_graphs_give_the_eager_tokens(policy, flex, monkeypatch):
    # The shipped model in fp32 on CUDA, greedy: the same tokens with the decode-only steps
    # replayed from CUDA graphs (several batch and width buckets: the prompts finish their
    # prefills at different steps and grow past block boundaries) as without; attention reading
    # the cache in place (FlexAttention) or gathering it.
    monkeypatch.setenv("BATON_FLEX_DECODE", flex)
    shipped = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cuda")
    assert shipped.model.reads_decode_cache_in_place(torch.float32, replayed=True) == (flex == "1")
    assert not shipped.model.reads_decode_cache_in_place(torch.float32)  # eager steps gather
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tokens = {}
    for graphs in (False, True):
        engine = Engine(shipped.model, shipped.tokenizer,
                        scheduler=SchedulerConfig(policy=policy, token_budget=64, max_running=4,
                                                  cuda_graphs=graphs),
                        kv=KVPoolConfig(block_size=16, num_blocks=256))
        replayer = engine.runner.graphs
        # sarathi: graphs captured as steps need them; separate: all of them first, as a
        # decode pod does before it serves (then no step captures one)
        captured = replayer.capture_all() if graphs and policy == "separate" else 0
        tokens[graphs] = [r.token_ids for r in engine.generate(PROMPTS, params)]
        if graphs:
            print(f"CUDA-GRAPHS {policy}: {replayer.num_graphs} graphs, "
                  f"{replayer.replayed_steps} replayed steps")
            assert replayer.enabled and replayer.num_graphs >= 2 and replayer.replayed_steps >= 40
            assert not captured or replayer.num_graphs == captured
        else:
            assert engine.runner.graphs is None
    assert tokens[True] == tokens[False]


def test_seeded_sampling_is_the_same_on_cuda_as_on_cpu():
    # The sampler draws on the CPU generator whatever the model's device, so a seed
    # means the same tokens on both (up to logits close enough not to flip a draw).
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7, max_tokens=24,
                            ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        shipped = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device=device)
        engine = Engine(shipped.model, shipped.tokenizer,
                        kv=KVPoolConfig(block_size=16, num_blocks=128))
        outputs[device] = [r.token_ids for r in engine.generate(PROMPTS[:2], params)]
    assert outputs["cuda"] == outputs["cpu"]


def chain_case(directory, device: str):
    """A tiny checkpoint saved in ``directory``, a 300-token prompt, and the in-process
    prefill on ``device`` that a chain must equal: (ids, logits on the host, its cache)."""
    config = tiny_config("llama3")
    model = random_model(config, seed=3)
    save_checkpoint(model, directory, dtype=torch.float32)
    model = model.to(device)  # a move after fusion: the model re-fuses on its first forward
    ids = torch.randint(0, config.vocab_size, (300,), generator=torch.Generator().manual_seed(5))
    kv = DenseKV(config.num_hidden_layers)
    logits = prefill(model, ids.to(device), torch.arange(300, device=device), kv)
    return ids, logits.cpu(), kv.complete_layers()


@pytest.mark.parametrize("mode", ["runahead", "tsp"])
def test_one_rank_nccl_chain_equals_single_process_prefill(tmp_path, mode):
    ids, logits, cache = chain_case(tmp_path, "cuda")
    source = ModelSource(path=str(tmp_path), dtype="float32")
    with LocalChain(source, ranks=1, backend="nccl", timeout_s=120) as chain:
        results = [chain.prefill(ids, mode=mode) for _ in range(2)]  # the chain serves on
    for result in results:
        assert (result.first_token_logits - logits).abs().max() < FP32_TOLERANCE
        for got, want in zip(result.layers, cache, strict=True):
            assert got.k.device.type == "cpu"  # handed across the process boundary on the host
            assert torch.equal(got.positions, want.positions.cpu())
            assert (got.k - want.k.cpu()).abs().max() < FP32_TOLERANCE
            assert (got.v - want.v.cpu()).abs().max() < FP32_TOLERANCE
        assert result.bytes_sent == 0  # one rank sends nothing
    print(f"CUDA-CHAIN nccl ranks=1 mode={mode} C=300 ttft={results[-1].ttft_s * 1e3:.1f} ms "
          f"max|dlogit|={float((results[-1].first_token_logits - logits).abs().max()):.2e}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two NCCL ranks need two GPUs")
def test_two_rank_nccl_chain_equals_single_process_prefill(tmp_path):
    ids, logits, _ = chain_case(tmp_path, "cuda")
    with LocalChain(ModelSource(path=str(tmp_path), dtype="float32"), ranks=2, backend="nccl",
                    timeout_s=120) as chain:
        result = chain.prefill(ids, boundaries=[0, 180, 300])
    assert (result.first_token_logits - logits).abs().max() < FP32_TOLERANCE


def test_cuda_engine_continues_from_a_cache_that_arrives_in_host_memory():
    # The decode pod's path: KV from a chain (or the wire) lands in host memory and enters
    # a CUDA engine's pool; greedy output equals the engine prefilling the prompt itself.
    shipped = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cuda")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt_ids = shipped.tokenizer.encode(PROMPTS[2])

    def engine() -> Engine:
        return Engine(shipped.model, shipped.tokenizer, kv=KVPoolConfig(block_size=16, num_blocks=128))

    expected = engine().generate([prompt_ids], params)[0].token_ids
    with LocalChain(ModelSource(dtype="float32"), ranks=1, backend="nccl", timeout_s=120) as chain:
        result = chain.prefill(prompt_ids)
    assert result.layers[0].k.device.type == "cpu"
    # as it comes (the engine copies it), and staged through pinned memory on the copy stream
    # (as a decode pod does with a pushed cache: ``baton.transfer.device_copy.to_device``)
    for layers in (result.layers, to_device(wire_layers(result.layers), torch.device("cuda"))):
        decoder = engine()
        request_id = decoder.add_prefilled_request(prompt_ids, layers, result.first_token_logits,
                                                   params)
        tokens = []
        while decoder.has_unfinished():
            tokens += [t for out in decoder.step() if out.request_id == request_id
                       for t in out.new_token_ids]
        assert tokens == expected


def wire_layers(layers):
    """A cache as a decode pod receives it: each layer's keys and values as message pieces."""
    pieces = []
    for layer in layers:
        k, v = (memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) for t in (layer.k, layer.v))
        # cut anywhere, as a sender cuts chunks by bytes
        pieces.append(ReceivedLayer(layer.positions, (k[:1000], k[1000:]), (v[:7], v[7:]), layer.k.dtype,
                                    layer.k.shape[1], layer.k.shape[2]))
    return pieces


def test_kv_copies_off_the_device_land_in_pinned_memory_intact():
    generator = torch.Generator(device="cuda").manual_seed(0)
    layers = [LayerKV(torch.randn(300, 4, 64, device="cuda", generator=generator),
                      torch.randn(300, 4, 64, device="cuda", generator=generator),
                      torch.arange(300, device="cuda")) for _ in range(3)]
    host_layers = layers_to_host(layers)
    for got, want in zip(host_layers, layers, strict=True):
        assert got.k.is_pinned() and got.v.is_pinned()
        assert torch.equal(got.k, want.k.cpu()) and torch.equal(got.v, want.v.cpu())
        assert torch.equal(got.positions, want.positions.cpu())
    # and back: a staged layer reads the same once its copy is waited for
    back = to_device(host_layers, torch.device("cuda"))
    stream = torch.cuda.current_stream()
    for got, want in zip(back, layers, strict=True):
        got.wait_on(stream)
        assert torch.equal(got.k, want.k) and torch.equal(got.positions, want.positions)


def test_a_steps_logits_cross_as_argmaxes_and_the_drawn_rows():
    logits = torch.randn(64, 4096, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    logits[5, 9] = logits[5, 7] = logits[5].max() + 1  # a tie: the first maximum wins, as on a CPU
    greedy, drawn = StepLogits(logits).pick([3, 40])
    assert greedy == StepLogits(logits.cpu()).pick([])[0] and greedy[5] == 7
    assert sorted(drawn) == [3, 40]
    for row, host in drawn.items():
        assert host.is_pinned() and torch.equal(host, logits[row].cpu())


def test_pyramid_compression_on_cuda_keeps_what_it_keeps_on_the_cpu():
    # PyramidInfer in a single-process prefill and inside the engine (prompt pruning, then
    # generation-phase pruning as tokens leave the recent window), fp32 on both devices.
    from baton.config import PyramidConfig
    from baton.pyramid import engine_compressor_factory, prefill_compressed
    from pyramid_fixtures import PROMPT_LENGTH, build_model

    config = PyramidConfig(keep_ratio=0.5)
    prompt = torch.randint(0, 256, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(1))
    results = {}
    for device in ("cpu", "cuda"):
        model = build_model().to(device)
        logits, layers = prefill_compressed(model, prompt.to(device), config)
        engine = Engine(model, None, scheduler=SchedulerConfig(token_budget=128),
                        kv=KVPoolConfig(block_size=8, num_blocks=2048),
                        compressor_factory=engine_compressor_factory(config, model.config))
        engine.add_request(prompt.tolist(), SamplingParams(
            temperature=0.0, max_tokens=160, ignore_eos=True))
        tokens = []
        while engine.has_unfinished():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        results[device] = (logits.cpu(), [x.positions.cpu() for x in layers],
                           [x.k.cpu() for x in layers], tokens)
    (cpu_logits, cpu_kept, cpu_k, cpu_tokens), (logits, kept, k, tokens) = results["cpu"], results["cuda"]
    assert (logits - cpu_logits).abs().max() < FP32_TOLERANCE
    assert all(torch.equal(a, b) for a, b in zip(kept, cpu_kept, strict=True))
    assert all((a - b).abs().max() < FP32_TOLERANCE for a, b in zip(k, cpu_k, strict=True))
    assert tokens == cpu_tokens and len(tokens) == 160


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the one-GPU fallback")
def test_a_two_rank_local_chain_on_one_gpu_runs_on_the_cpu(tmp_path):
    # NCCL refuses two ranks on one GPU: a local chain of 2 falls back to gloo on the CPU.
    ids, logits, _ = chain_case(tmp_path, "cpu")
    # fp32 named: "auto" is bf16 on a CPU with AVX512-BF16, as GPU hosts often have
    with LocalChain(ModelSource(path=str(tmp_path), dtype="float32"), ranks=2, timeout_s=120) as chain:
        result = chain.prefill(ids, boundaries=[0, 180, 300])
    assert (result.first_token_logits - logits).abs().max() < FP32_TOLERANCE
    assert result.layers[0].k.dtype == torch.float32  # the CPU's dtype: it ran on the CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_flex_attention_reads_the_paged_cache_as_the_gathered_read_does(dtype, batch):
    # A pool whose blocks lie scattered, rows of ragged lengths (a partly filled last block,
    # an exactly full one, one token), read where they lie and gathered into padded tensors.
    from baton.kernels.flex_decode import PagedFlexDecode, fits
    from baton.kv.decode_step import DecodeGroup, DecodeStep
    from baton.model.attention import attend_decode_batch, decode_attention_bias

    generator = torch.Generator(device="cuda").manual_seed(batch)
    block_size, kv_heads, heads, head_dim, width = 16, 2, 8, 64, 9
    num_blocks = batch * width + 5
    assert fits(dtype, torch.device("cuda"), head_dim, heads, kv_heads)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype,
                          generator=generator)
    v_cache = torch.randn_like(k_cache)
    blocks = (torch.randperm(num_blocks - 1, device="cuda", generator=generator)[:batch * width]
              + 1).view(batch, width)
    lengths = torch.tensor([137, 16, 1, 144, 50, 99, 33, 17][:batch], device="cuda")
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype, generator=generator)
    step = DecodeStep(torch.zeros(1, batch, dtype=torch.long, device="cuda"), [], k_cache, v_cache,
                      torch.zeros(num_blocks, block_size, dtype=torch.long, device="cuda"))
    k, v, _, count = step.read(DecodeGroup(slice(0, batch), [blocks], lengths[None], True), 0,
                               with_positions=False)
    expected = attend_decode_batch(q, k, v, decode_attention_bias(None, None, count, k.shape[1],
                                                                  None, dtype))
    reader = PagedFlexDecode(num_blocks, block_size, torch.device("cuda"))
    got = reader(q, k_cache, v_cache, blocks, lengths)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    print(f"CUDA-FLEX batch={batch} {dtype} max|diff|={float((got - expected).abs().max()):.1e}")
    assert (got.float() - expected.float()).abs().max() < tolerance
    # the same reader again with other lengths: its buffers are reused, nothing stale leaks in
    shorter = (lengths // 2).clamp(min=1)
    k, v, _, count = step.read(DecodeGroup(slice(0, batch), [blocks], shorter[None], True), 0,
                               with_positions=False)
    expected = attend_decode_batch(q, k, v, decode_attention_bias(None, None, count, k.shape[1],
                                                                  None, dtype))
    assert (reader(q, k_cache, v_cache, blocks, shorter).float() - expected.float()).abs().max() < tolerance
