"""`baton train`: the shipped small model, trained on the Python standard library."""

from __future__ import annotations

from baton.configtree import require, setting, settings


@settings("train")
class TrainConfig:
    """`baton train`: the shipped small model, trained on the Python standard library."""

    output_dir: str = setting("", "where the checkpoint goes; empty = models/baton-pystdlib")
    corpus_dir: str = setting("", "directory of *.py files; empty = this interpreter's stdlib")
    held_out_percent: int = setting(5, "percent of files (by a hash of their path) held out",
                                    minimum=1, maximum=99)
    vocab_size: int = setting(4096, "byte-level BPE vocabulary, end-of-text token included",
                              minimum=1)
    hidden_size: int = setting(256, "model width", minimum=1)
    num_layers: int = setting(4, "decoder layers", minimum=1)
    num_heads: int = setting(8, "query heads", minimum=1)
    num_kv_heads: int = setting(2, "key/value heads (fewer than num_heads: GQA)", minimum=1)
    intermediate_size: int = setting(688, "SwiGLU hidden width", minimum=1)
    context_length: int = setting(1024, "max_position_embeddings and the final training sequence length",
                                  minimum=1)
    short_context_length: int = setting(256, "sequence length of the first phase (cheaper attention)",
                                        minimum=1)
    short_context_fraction: float = setting(0.7, "fraction of steps trained at short_context_length",
                                            minimum=0, exclusive_maximum=1)
    batch_tokens: int = setting(4096, "tokens per optimizer step (sequences x length)", minimum=1)
    steps: int = setting(2600, "optimizer steps (a fixed count, not a wall-clock budget)", minimum=1)
    warmup_steps: int = setting(60, "linear learning-rate warmup steps", minimum=0)
    learning_rate: float = setting(3e-3, "peak AdamW learning rate (cosine decay after warmup)")
    min_learning_rate: float = setting(1e-4, "learning rate at the end of the cosine", exclusive_minimum=0)
    weight_decay: float = setting(0.1, "AdamW weight decay on matrices", minimum=0)
    grad_clip: float = setting(1.0, "global gradient-norm clip", exclusive_minimum=0)
    eval_every: int = setting(200, "steps between held-out evaluations and checkpoint saves", minimum=1)
    eval_windows: int = setting(16, "held-out windows scored at each periodic evaluation (0 = all)",
                                minimum=0)
    seed: int = setting(0, "seed of weights and batch sampling")
    threads: int = setting(2, "torch intra-op threads", minimum=1)

    def __post_init__(self) -> None:
        require(self.vocab_size >= 257,
                f"train vocab_size {self.vocab_size} must exceed 256 (bytes + end-of-text)")
        require(self.hidden_size % self.num_heads == 0,
                f"train hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        require(self.num_heads % self.num_kv_heads == 0,
                f"train num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        require(self.short_context_length <= self.context_length,
                f"train short_context_length {self.short_context_length} exceeds "
                f"context_length {self.context_length}")
        require(self.batch_tokens >= self.context_length,
                f"train batch_tokens {self.batch_tokens} must hold one sequence of "
                f"context_length {self.context_length}")
        require(self.warmup_steps < self.steps,
                f"train warmup_steps {self.warmup_steps} must be in 0..steps-1 ({self.steps - 1})")
        require(self.min_learning_rate <= self.learning_rate,
                f"train min_learning_rate {self.min_learning_rate} must be in (0, learning_rate "
                f"{self.learning_rate}]")
