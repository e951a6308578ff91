"""The peer benchmark's workload: the same requests for baton and vLLM, saved as JSON.

Prompts are cut from the Python standard library's source (every machine has it) with
lengths drawn uniformly from [min, max] tokens under a fixed seed; every request
generates the same number of new tokens, greedy, ignoring end-of-sequence, so both
systems do the same work and must produce the same token ids.

Each prompt is kept as text and as the token ids of that text (``encode(decode(cut))``,
which can differ from the cut by a token at the seams): the offline runs take the ids, the
served runs send the text, which both servers tokenize with the same ``tokenizer.json`` into
the same ids. The warm-up prompt is none of the workload's, so that a prefix cache (vLLM's
is on by default) gains nothing from the warm-up.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

NUM_REQUESTS = 256
MIN_PROMPT_TOKENS = 50
MAX_PROMPT_TOKENS = 900
NEW_TOKENS = 64
SEED = 2026
WARMUP_TOKENS = 600  # long enough for baton up's chain route (>= 512 tokens)


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids of each request's prompt
    texts: list[str]  # the same prompts as text (what a served client sends)
    warmup: list[int]  # a prompt outside the workload, for warming a system up
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

    def save_texts(self, path: Path) -> Path:
        """The prompts as ``vllm bench serve``'s custom dataset: one JSON line per prompt."""
        path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in self.texts))
        return path

    def first(self, count: int) -> Workload:
        return Workload(self.prompts[:count], self.texts[:count], self.warmup, self.new_tokens,
                        self.seed)


def make_workload(tokenizer, num_requests: int = NUM_REQUESTS, seed: int = SEED,
                  min_tokens: int = MIN_PROMPT_TOKENS, max_tokens: int = MAX_PROMPT_TOKENS,
                  new_tokens: int = NEW_TOKENS) -> Workload:
    """``tokenizer``: baton's (``encode(text) -> list[int]``, ``decode(ids) -> str``)."""
    rng = random.Random(seed)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))

    def cut(length: int) -> tuple[list[int], str]:
        while True:
            ids = tokenizer.encode(rng.choice(sources).read_text(errors="replace"))
            if len(ids) < length:
                continue
            start = rng.randint(0, len(ids) - length)
            text = tokenizer.decode(ids[start:start + length])
            stable = tokenizer.encode(text)
            if tokenizer.decode(stable) == text and min_tokens <= len(stable) <= max_tokens:
                return stable, text

    prompts, texts = [], []
    for _ in range(num_requests):
        ids, text = cut(rng.randint(min_tokens, max_tokens))
        prompts.append(ids)
        texts.append(text)
    warmup, _ = cut(WARMUP_TOKENS)
    return Workload(prompts, texts, warmup, new_tokens, seed)


def make_shared_prefix_workload(tokenizer, num_groups: int = 4, num_documents: int = 8,
                                num_questions: int = 8, seed: int = SEED,
                                document_tokens: tuple[int, int] = (660, 700),
                                question_tokens: tuple[int, int] = (40, 140),
                                new_tokens: int = NEW_TOKENS) -> Workload:
    """Prompts that share prefixes, as RAG or a shared system prompt makes them: each group has
    ``num_documents`` documents, each asked ``num_questions`` different questions (document +
    question in one prompt), the questions interleaved across documents (document 0's first
    question, document 1's first, ...), the groups one after another. Documents and questions
    are cut from the standard library's source like ``make_workload``'s prompts."""
    rng = random.Random(seed)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))

    def cut(length: int) -> str:
        while True:
            ids = tokenizer.encode(rng.choice(sources).read_text(errors="replace"))
            if len(ids) >= length:
                start = rng.randint(0, len(ids) - length)
                return tokenizer.decode(ids[start:start + length])

    prompts, texts = [], []
    for _ in range(num_groups):
        documents = [cut(rng.randint(*document_tokens)) for _ in range(num_documents)]
        questions = [[cut(rng.randint(*question_tokens)) for _ in range(num_questions)]
                     for _ in documents]
        for question in range(num_questions):
            for document, asked in zip(documents, questions):
                # the text both systems tokenize, and the ids that text gives (stable by round trip)
                text = tokenizer.decode(tokenizer.encode(document + "\n" + asked[question]))
                prompts.append(tokenizer.encode(text))
                texts.append(text)
    warmup = tokenizer.encode(cut(WARMUP_TOKENS))
    return Workload(prompts, texts, warmup, new_tokens, seed)
