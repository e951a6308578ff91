"""A random-weight checkpoint with a real byte-level tokenizer, for command-line tests."""

from __future__ import annotations

from pathlib import Path

from hf_reference import save_random_hf_model, tiny_config
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def save_byte_tokenizer(directory: Path) -> None:
    """A byte-level BPE over exactly the 256 byte symbols (ids fit tiny_config's vocab of 256)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(["def main():\n    return 0\n"], trainer)
    tokenizer.save(str(directory / "tokenizer.json"))


def save_cli_checkpoint(directory: Path) -> Path:
    save_random_hf_model(tiny_config("llama2"), directory)
    save_byte_tokenizer(directory)
    return directory
