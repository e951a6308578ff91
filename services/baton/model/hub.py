"""Where a model's files are: a checkpoint directory, or a Hugging Face repo id resolved the
way ``transformers`` and vLLM resolve it.

``--model`` takes a directory (empty: the shipped model) or a repo id (``org/name``). A repo
id is looked up in the local Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``) at the
requested revision (a branch, tag or commit; default ``main``) and, where the network
allows and ``HF_HUB_OFFLINE`` is not set, downloaded into it first (``huggingface_hub``,
with ``HF_TOKEN`` for gated repos). A model found that way is called by its repo id, and
its KV caches are labelled with the snapshot's commit, so prefill and decode pods that
resolved different commits never exchange KV.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from baton.model.errors import CheckpointError

SHIPPED_MODEL_DIR = Path(__file__).resolve().parents[3] / "models" / "baton-pystdlib"
# The files a server reads; weights in safetensors only (no pickle anywhere).
CHECKPOINT_FILES = ["config.json", "generation_config.json", "*.safetensors",
                    "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja"]


@dataclass(frozen=True)
class ModelFiles:
    directory: Path
    name: str  # what clients call it by default: the repo id, or the directory's name
    revision: str  # the label its KV caches carry: the snapshot's commit, or the directory's name


def is_repo_id(path: str) -> bool:
    """``org/name`` (or ``name``) that is no existing path: what the Hub would resolve."""
    if not path or Path(path).exists() or path.startswith(("/", ".", "~")):
        return False
    parts = path.split("/")
    return len(parts) <= 2 and all(parts) and not path.endswith(("/", ".json"))


def resolve_model(path: str | Path = "", revision: str = "") -> ModelFiles:
    """The files of ``--model`` at ``revision`` (see the module's docstring); raises
    ``CheckpointError`` naming what is missing."""
    text = str(path)
    if not is_repo_id(text):
        directory = Path(text).expanduser() if text else SHIPPED_MODEL_DIR
        if not directory.is_dir():
            raise CheckpointError(str(directory), "directory", "does not exist (nor is it a "
                                  "Hugging Face repo id in the local cache)")
        return ModelFiles(directory, directory.name, revision or directory.name)
    directory = _snapshot(text, revision)
    return ModelFiles(directory, text, directory.name)


def fetch_model(repo_id: str, revision: str = "", weights: bool = True) -> tuple[ModelFiles, bool]:
    """Put ``repo_id`` at ``revision`` into the local Hugging Face cache, unless a snapshot
    holding every file a server reads is there already; returns its files and whether it
    downloaded. Without ``weights`` the safetensors are left out (what a gateway reads).
    ``HF_HUB_OFFLINE`` turns a missing file into an error instead of a download."""
    patterns = CHECKPOINT_FILES if weights else [p for p in CHECKPOINT_FILES
                                                  if p != "*.safetensors"]
    try:
        directory = _cached_snapshot(repo_id, revision, patterns)
    except CheckpointError:
        if _offline():
            raise
        missing = ["every file"]  # not cached yet
    else:
        if not (missing := missing_files(directory, weights)):
            return ModelFiles(directory, repo_id, directory.name), False
    if _offline():  # in the cache, but incomplete
        raise CheckpointError(repo_id, "snapshot", f"at revision {revision or 'main'} lacks "
                              f"{', '.join(missing)} in the Hugging Face cache, and "
                              f"HF_HUB_OFFLINE forbids completing it")
    directory = _downloaded_snapshot(repo_id, revision, patterns)
    if missing := missing_files(directory, weights):
        raise CheckpointError(repo_id, "snapshot", f"at revision {revision or 'main'} has no "
                              f"{', '.join(missing)} (baton reads Llama-family checkpoints "
                              f"in safetensors)")
    return ModelFiles(directory, repo_id, directory.name), True


def missing_files(directory: Path, weights: bool = True) -> list[str]:
    """The files a server reads that ``directory`` lacks (an interrupted download's snapshot,
    or a gateway's without weights)."""
    needed = ["config.json", "tokenizer.json"]
    if weights:
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            needed += sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            needed.append("model.safetensors")
    return [name for name in needed if not (directory / name).is_file()]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _snapshot(repo_id: str, revision: str) -> Path:
    """The snapshot from the cache, else (unless offline) downloaded into it."""
    try:
        return _cached_snapshot(repo_id, revision)
    except CheckpointError:
        if _offline():
            raise
    return _downloaded_snapshot(repo_id, revision)


def _cached_snapshot(repo_id: str, revision: str,
                     patterns: list[str] = CHECKPOINT_FILES) -> Path:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(huggingface_hub.snapshot_download(
            repo_id, revision=revision or None, allow_patterns=patterns, local_files_only=True))
    except LocalEntryNotFoundError as e:  # an incomplete snapshot too, where the Hub's listing is kept
        offline = ", and HF_HUB_OFFLINE forbids a download" if _offline() else ""
        raise CheckpointError(repo_id, "snapshot", f"is not in the Hugging Face cache "
                              f"({huggingface_hub.constants.HF_HUB_CACHE}) at revision "
                              f"{revision or 'main'}{offline}") from e


def _downloaded_snapshot(repo_id: str, revision: str,
                         patterns: list[str] = CHECKPOINT_FILES) -> Path:
    import huggingface_hub

    try:  # files already in the cache are not fetched again
        return Path(huggingface_hub.snapshot_download(
            repo_id, revision=revision or None, allow_patterns=patterns))
    except Exception as e:
        raise CheckpointError(repo_id, "snapshot", f"could not be downloaded at revision "
                              f"{revision or 'main'}: {e}") from e
