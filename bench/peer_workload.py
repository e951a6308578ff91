"""The peer benchmark's workload: the same requests for baton and vLLM, saved as JSON.

Prompts are cut from the Python standard library's source (every machine has it),
tokenized with the shipped model's tokenizer, with lengths drawn uniformly from
[min, max] tokens under a fixed seed; every request generates the same number of
new tokens, greedy, ignoring end-of-sequence, so both systems do the same work and
must produce the same token ids.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

NUM_REQUESTS = 64
MIN_PROMPT_TOKENS = 50
MAX_PROMPT_TOKENS = 900
NEW_TOKENS = 64
SEED = 2026


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids of each request's prompt
    new_tokens: int
    seed: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def load(cls, path: Path) -> Workload:
        return cls(**json.loads(Path(path).read_text()))

    def first(self, count: int) -> Workload:
        return Workload(self.prompts[:count], self.new_tokens, self.seed)


def make_workload(tokenizer, num_requests: int = NUM_REQUESTS, seed: int = SEED,
                  min_tokens: int = MIN_PROMPT_TOKENS, max_tokens: int = MAX_PROMPT_TOKENS,
                  new_tokens: int = NEW_TOKENS) -> Workload:
    """``tokenizer``: baton's (``encode(text) -> list[int]``)."""
    rng = random.Random(seed)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    prompts: list[list[int]] = []
    while len(prompts) < num_requests:
        text = rng.choice(sources).read_text(errors="replace")
        ids = tokenizer.encode(text)
        length = rng.randint(min_tokens, max_tokens)
        if len(ids) < length:
            continue
        start = rng.randint(0, len(ids) - length)
        prompts.append(ids[start:start + length])
    return Workload(prompts, new_tokens, seed)
