"""`baton train`: the shipped small model, from the stdlib's source to a checkpoint.

Steps: split the corpus by file -> train a byte-level BPE tokenizer on the
training files -> one token stream (documents separated by end-of-text) ->
AdamW over random windows of that stream, linear warmup then cosine decay,
first at a short sequence length (attention is cheaper, updates come faster)
then at the full context so that long prompts mean something -> fp16
safetensors + tokenizer.json, and the held-out loss of exactly those fp16
weights.

The run is a fixed number of steps (not a wall-clock budget), so the same
command gives the same model on any machine, only slower or faster; with one
seed and ``torch.set_num_threads`` fixed it is deterministic up to the float
summation order of the CPU kernels.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from baton.config import TrainConfig
from baton.model.config import ModelConfig
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.llama import CausalLM
from baton.model.loader import load_checkpoint, save_checkpoint
from baton.model.tokenizer import Tokenizer
from baton.train.bpe import encode_documents, train_tokenizer
from baton.train.corpus import END_OF_TEXT, read_documents, split_corpus
from baton.train.forward import next_token_loss
from baton.train.sample import greedy_continuation

SAMPLE_PROMPT = "def fibonacci(n):\n"
SAMPLE_TOKENS = 48
EVAL_BATCH = 4  # held-out windows per no-grad forward


@dataclass
class TrainResult:
    """What a run produced; also written to ``training.json`` beside the weights."""

    output_dir: str
    num_parameters: int
    train_files: int
    held_out_files: int
    train_tokens: int
    held_out_tokens: int
    tokens_seen: int
    seconds: float
    held_out_loss: float  # mean cross-entropy, nats per token, of the saved fp16 weights
    held_out_perplexity: float
    history: list[dict] = field(default_factory=list)


def model_config(config: TrainConfig, vocab_size: int, end_of_text: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.context_length,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        eos_token_id=end_of_text,
    )


def initialize(model: CausalLM) -> None:
    """GPT-2 style: N(0, 0.02), residual outputs shrunk by sqrt(2 * layers) so depth adds no variance."""
    residual_std = 0.02 / math.sqrt(2 * model.config.num_hidden_layers)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() < 2:
                continue  # norms keep their ones
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            parameter.normal_(0.0, std)


def make_optimizer(model: CausalLM, config: TrainConfig) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": matrices, "weight_decay": config.weight_decay},
         {"params": vectors, "weight_decay": 0.0}],
        lr=config.learning_rate, betas=(0.9, 0.95), eps=1e-8)


def learning_rate(config: TrainConfig, step: int) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - 1 - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return config.min_learning_rate + (config.learning_rate - config.min_learning_rate) * cosine


def sequence_length(config: TrainConfig, step: int) -> int:
    short_steps = int(config.steps * config.short_context_fraction)
    return config.short_context_length if step < short_steps else config.context_length


def sample_windows(stream: torch.Tensor, count: int, length: int,
                   generator: torch.Generator) -> torch.Tensor:
    """``count`` random windows of ``length`` consecutive tokens: [count, length] int64."""
    starts = torch.randint(0, stream.shape[0] - length + 1, (count,), generator=generator)
    return torch.stack([stream[s:s + length] for s in starts.tolist()]).long()


def held_out_windows(stream: torch.Tensor, length: int, limit: int = 0) -> torch.Tensor:
    """Non-overlapping windows of ``length`` + 1 tokens (the last predicts the next window's
    first): [W, length + 1]; every held-out token is predicted once. ``limit`` > 0 keeps the
    first ``limit`` windows."""
    count = (stream.shape[0] - 1) // length
    if limit:
        count = min(count, limit)
    return torch.stack([stream[i * length:i * length + length + 1] for i in range(count)]).long()


@torch.no_grad()
def held_out_loss(model: CausalLM, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy over all windows' tokens (nats per token)."""
    total = 0.0
    for start in range(0, windows.shape[0], EVAL_BATCH):
        batch = windows[start:start + EVAL_BATCH]
        total += next_token_loss(model, batch).item() * batch.shape[0]
    return total / windows.shape[0]


def save(model: CausalLM, tokenizer, directory: Path) -> None:
    """Write the checkpoint beside ``directory`` and move each file in, so that a reader
    never sees a half-written file."""
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    save_checkpoint(model, staging, torch.float16)
    tokenizer.save(str(staging / "tokenizer.json"))
    directory.mkdir(parents=True, exist_ok=True)
    for path in staging.iterdir():
        os.replace(path, directory / path.name)
    staging.rmdir()


def train(config: TrainConfig, log: Callable[[str], None] = print) -> TrainResult:
    started = time.perf_counter()
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    output_dir = Path(config.output_dir) if config.output_dir else SHIPPED_MODEL_DIR

    split = split_corpus(config.corpus_dir or None, config.held_out_percent)
    if not split.held_out_files:
        raise ValueError(f"corpus {str(split.root)!r} has no held-out file at held_out_percent "
                         f"{config.held_out_percent}; add files or raise the percentage")
    train_documents = read_documents(split, split.train_files)
    tokenizer = train_tokenizer(train_documents, config.vocab_size)
    train_stream = torch.tensor(encode_documents(tokenizer, train_documents), dtype=torch.int32)
    held_out_stream = torch.tensor(
        encode_documents(tokenizer, read_documents(split, split.held_out_files)), dtype=torch.int32)
    for name, stream in (("training", train_stream), ("held-out", held_out_stream)):
        if stream.shape[0] <= config.context_length:
            raise ValueError(f"the {name} split has {stream.shape[0]} tokens, not more than "
                             f"context_length {config.context_length}; use a bigger corpus or a "
                             f"shorter context")
    log(f"corpus {split.root}: {len(split.train_files)} training files ({train_stream.shape[0]} "
        f"tokens), {len(split.held_out_files)} held out ({held_out_stream.shape[0]} tokens); "
        f"vocabulary {tokenizer.get_vocab_size()}")

    model = CausalLM(model_config(config, tokenizer.get_vocab_size(), tokenizer.token_to_id(END_OF_TEXT)))
    initialize(model)
    model.train()
    optimizer = make_optimizer(model, config)
    generator = torch.Generator().manual_seed(config.seed)
    eval_windows = held_out_windows(held_out_stream, config.context_length, config.eval_windows)
    num_parameters = sum(p.numel() for p in model.parameters())
    log(f"model: {num_parameters / 1e6:.2f}M parameters, {config.steps} steps of "
        f"{config.batch_tokens} tokens")

    history: list[dict] = []
    tokens_seen = 0
    last_log = time.perf_counter()
    tokens_since_log = 0
    for step in range(config.steps):
        length = sequence_length(config, step)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        windows = sample_windows(train_stream, config.batch_tokens // length, length + 1, generator)
        loss = next_token_loss(model, windows)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += windows.shape[0] * length
        tokens_since_log += windows.shape[0] * length
        if (step + 1) % 10 == 0:
            now = time.perf_counter()
            log(f"step {step + 1}/{config.steps} len {length} lr {learning_rate(config, step):.2e} "
                f"loss {loss.item():.3f} {tokens_since_log / (now - last_log):.0f} tok/s "
                f"elapsed {now - started:.0f}s")
            last_log, tokens_since_log = now, 0
        if (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            history.append(evaluate(model, tokenizer, eval_windows, output_dir, step + 1, started, log))

    history.append(evaluate(model, tokenizer, eval_windows, output_dir, config.steps, started, log))
    # The reported loss is that of the shipped fp16 weights, loaded back as any user would.
    shipped = load_checkpoint(output_dir, dtype="float32", device="cpu").model
    final_loss = held_out_loss(shipped, held_out_windows(held_out_stream, config.context_length))
    result = TrainResult(
        output_dir=str(output_dir), num_parameters=num_parameters,
        train_files=len(split.train_files), held_out_files=len(split.held_out_files),
        train_tokens=int(train_stream.shape[0]), held_out_tokens=int(held_out_stream.shape[0]),
        tokens_seen=tokens_seen, seconds=time.perf_counter() - started,
        held_out_loss=final_loss, held_out_perplexity=math.exp(final_loss), history=history)
    report = {"result": asdict(result), "config": asdict(config)}
    (output_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"held-out loss {final_loss:.4f} nats/token (perplexity {result.held_out_perplexity:.2f}) "
        f"over {held_out_stream.shape[0]} tokens; {result.seconds:.0f}s; saved to {output_dir}")
    return result


def evaluate(model: CausalLM, tokenizer, windows: torch.Tensor, output_dir: Path, step: int,
             started: float, log: Callable[[str], None]) -> dict:
    """Score the held-out windows, save a checkpoint and show a greedy sample."""
    model.eval()
    loss = held_out_loss(model, windows)
    save(model, tokenizer, output_dir)
    sample = greedy_continuation(model, Tokenizer(tokenizer), SAMPLE_PROMPT, SAMPLE_TOKENS)
    model.train()
    elapsed = time.perf_counter() - started
    log(f"eval step {step}: held-out loss {loss:.4f} (perplexity {math.exp(loss):.2f}) "
        f"elapsed {elapsed:.0f}s; sample:\n{SAMPLE_PROMPT}{sample}\n---")
    return {"step": step, "held_out_loss": loss, "elapsed_s": elapsed}
