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


def _snapshot(repo_id: str, revision: str) -> Path:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        return Path(huggingface_hub.snapshot_download(
            repo_id, revision=revision or None, allow_patterns=CHECKPOINT_FILES,
            local_files_only=True))
    except LocalEntryNotFoundError as cached_error:
        if offline:
            raise CheckpointError(repo_id, "snapshot", f"is not in the Hugging Face cache "
                                  f"({huggingface_hub.constants.HF_HUB_CACHE}) at revision "
                                  f"{revision or 'main'}, and HF_HUB_OFFLINE forbids a "
                                  f"download") from cached_error
    try:
        return Path(huggingface_hub.snapshot_download(
            repo_id, revision=revision or None, allow_patterns=CHECKPOINT_FILES))
    except Exception as e:
        raise CheckpointError(repo_id, "snapshot", f"could not be downloaded at revision "
                              f"{revision or 'main'}: {e}") from e
