"""`baton train` end to end on a tiny corpus and a tiny model: a checkpoint the runtime loads."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
from baton.commands import train as train_command
from baton.config import TrainConfig
from baton.model import load_checkpoint
from baton.train.corpus import END_OF_TEXT, split_corpus, stdlib_root
from baton.train.trainer import learning_rate, sequence_length

# Small, varied stdlib modules: enough text for a few hundred BPE merges.
SOURCES = ["abc.py", "bisect.py", "colorsys.py", "copy.py", "fnmatch.py", "genericpath.py",
           "glob.py", "heapq.py", "keyword.py", "linecache.py", "numbers.py", "opcode.py",
           "queue.py", "sched.py", "shlex.py", "stat.py", "string.py", "textwrap.py"]
TINY_FLAGS = ["--vocab-size", "320", "--hidden-size", "32", "--num-layers", "2", "--num-heads", "4",
              "--num-kv-heads", "2", "--intermediate-size", "64", "--context-length", "64",
              "--short-context-length", "32", "--short-context-fraction", "0.5",
              "--batch-tokens", "256", "--steps", "6", "--warmup-steps", "2", "--eval-every", "3",
              "--eval-windows", "2", "--held-out-percent", "20", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for name in SOURCES:
        shutil.copy(stdlib_root() / name, root / name)
    split = split_corpus(root, 20)
    assert split.train_files and split.held_out_files, "the fixture needs files on both sides"
    return root


def run_tool(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    return train_command.run(parser.parse_args(argv))


def test_train_tool_writes_a_checkpoint_the_runtime_loads(tiny_corpus, tmp_path, capsys):
    output = tmp_path / "model"
    assert run_tool(["--corpus-dir", str(tiny_corpus), "--output-dir", str(output)] + TINY_FLAGS) == 0

    loaded = load_checkpoint(output, dtype="float32", device="cpu")
    config = loaded.config
    assert (config.hidden_size, config.num_hidden_layers, config.max_position_embeddings) == (32, 2, 64)
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.vocab_size == loaded.tokenizer.vocab_size <= 320
    assert config.eos_token_id == loaded.tokenizer.token_id(END_OF_TEXT)
    text = "def f(x):\n    return x\n"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == text

    report = json.loads((output / "training.json").read_text())["result"]
    assert [entry["step"] for entry in report["history"]] == [3, 6]
    assert report["tokens_seen"] == 3 * 256 + 3 * 256
    assert 0 < report["held_out_loss"] < 7  # below log(320) = 5.77 plus fp16 slack: it learned something
    log = capsys.readouterr().out
    assert "held-out loss" in log and "saved to" in log
    assert not (tmp_path / "model.partial").exists()


def test_schedules_follow_the_config():
    config = TrainConfig(steps=100, warmup_steps=10, learning_rate=1e-3, min_learning_rate=1e-4,
                         short_context_fraction=0.25)
    assert learning_rate(config, 0) == pytest.approx(1e-4)
    assert learning_rate(config, 9) == pytest.approx(1e-3)
    assert learning_rate(config, 99) == pytest.approx(1e-4)
    assert [sequence_length(config, s) for s in (0, 24, 25, 99)] == [256, 256, 1024, 1024]


@pytest.mark.parametrize("overrides, named", [
    ({"num_heads": 8, "num_kv_heads": 3}, "num_kv_heads 3"),
    ({"context_length": 512, "short_context_length": 1024}, "short_context_length 1024"),
    ({"vocab_size": 200}, "vocab_size 200"),
    ({"batch_tokens": 100}, "batch_tokens 100"),
])
def test_bad_config_is_a_value_error_naming_the_value(overrides, named):
    with pytest.raises(ValueError, match=named):
        TrainConfig(**overrides)


def test_a_corpus_too_small_for_the_context_is_named(tiny_corpus, tmp_path):
    with pytest.raises(ValueError, match="context_length 100000"):
        run_tool(["--corpus-dir", str(tiny_corpus), "--output-dir", str(tmp_path)] + TINY_FLAGS
                 + ["--context-length", "100000", "--batch-tokens", "100000"])
