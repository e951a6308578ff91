"""The training corpus: the Python standard library of the running interpreter.

Every machine that runs baton has it, so the shipped model can be retrained and
evaluated offline. Documents are the ``*.py`` files under
``sysconfig.get_paths()["stdlib"]``, minus ``site-packages`` (third-party code,
different on every machine) and the test suites (``test``, ``tests``,
``idle_test`` directories: large, repetitive, and full of deliberately broken
code). The held-out split is by file and deterministic: a file is held out when
the SHA-256 of its relative path falls in the first ``held_out_percent`` of 100
buckets, so the split is the same on every machine and for every run, and a
file added by a newer Python lands on a stable side.

Public API (benchmarks import it):

* ``split_corpus(root=None, held_out_percent=5) -> CorpusSplit``: the two file lists;
* ``read_documents(split, files) -> list[str]``: the files' text;
* ``held_out_text(root=None) -> str``: all held-out files joined by the
  end-of-text token, exactly as the model saw training text.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

END_OF_TEXT = "<|endoftext|>"
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__",
                           "encodings", "pydoc_data"})
DEFAULT_HELD_OUT_PERCENT = 5


@dataclass(frozen=True)
class CorpusSplit:
    """Relative paths (POSIX style, sorted) of the files on each side of the split."""

    root: Path
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str, held_out_percent: int) -> bool:
    """Deterministic: depends only on the path's text, never on the machine or a seed."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < held_out_percent


def list_sources(root: Path) -> list[str]:
    """Relative paths of the corpus's ``*.py`` files, sorted, excluded directories skipped."""
    paths = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if EXCLUDED_DIRS.isdisjoint(relative.parts[:-1]) and path.is_file():
            paths.append(relative.as_posix())
    return sorted(paths)


def split_corpus(root: str | Path | None = None,
                 held_out_percent: int = DEFAULT_HELD_OUT_PERCENT) -> CorpusSplit:
    """Split the corpus under ``root`` (default: the interpreter's stdlib) by file."""
    if not 0 < held_out_percent < 100:
        raise ValueError(f"held_out_percent must be in 1..99, got {held_out_percent}")
    root = Path(root) if root else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"corpus directory {str(root)!r} does not exist")
    files = list_sources(root)
    if not files:
        raise ValueError(f"corpus directory {str(root)!r} holds no *.py files")
    held_out = tuple(f for f in files if is_held_out(f, held_out_percent))
    train = tuple(f for f in files if not is_held_out(f, held_out_percent))
    return CorpusSplit(root, train, held_out)


def read_documents(split: CorpusSplit, files: tuple[str, ...]) -> list[str]:
    """The text of ``files``; a file that is not UTF-8 is read with replacement characters."""
    return [(split.root / f).read_text(encoding="utf-8", errors="replace") for f in files]


def held_out_text(root: str | Path | None = None,
                  held_out_percent: int = DEFAULT_HELD_OUT_PERCENT) -> str:
    """Every held-out file, in path order, joined by END_OF_TEXT (as in training)."""
    split = split_corpus(root, held_out_percent)
    return END_OF_TEXT.join(read_documents(split, split.held_out_files))
