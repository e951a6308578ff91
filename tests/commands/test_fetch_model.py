"""`baton fetch-model` against a Hugging Face cache laid out as huggingface_hub lays it out,
with the Hub itself faked: the real library looks in the cache, a stand-in "downloads" by
writing the snapshot the Hub would have sent. No network."""

from __future__ import annotations

import fnmatch
import shutil

import huggingface_hub
import pytest
from baton.cli import main
from baton.model.errors import CheckpointError
from baton.model.hub import fetch_model, resolve_model
from commands.cli_checkpoint import save_cli_checkpoint

REPO_ID = "acme/tiny-coder"
COMMIT = "5e1f0c2b" * 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_cli_checkpoint(tmp_path_factory.mktemp("checkpoint"))


class FakeHub:
    """The Hub's side of ``snapshot_download``: each download it serves is recorded."""

    def __init__(self, checkpoint, cache, monkeypatch):
        self.checkpoint, self.cache = checkpoint, cache
        self.downloads: list[tuple[str, str | None, list[str]]] = []
        self.real = huggingface_hub.snapshot_download
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)

    def snapshot_download(self, repo_id, revision=None, allow_patterns=None,
                          local_files_only=False, **kwargs):
        if local_files_only:
            return self.real(repo_id, revision=revision, allow_patterns=allow_patterns,
                             local_files_only=True, **kwargs)
        self.downloads.append((repo_id, revision, list(allow_patterns)))
        repo = self.cache / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo / "snapshots" / COMMIT
        snapshot.mkdir(parents=True, exist_ok=True)
        for file in self.checkpoint.iterdir():
            if any(fnmatch.fnmatch(file.name, p) for p in allow_patterns):
                shutil.copy(file, snapshot / file.name)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / (revision or "main")).write_text(COMMIT)
        return str(snapshot)


@pytest.fixture
def hub(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return FakeHub(checkpoint, tmp_path, monkeypatch)


def test_a_model_is_downloaded_once_then_found_in_the_cache(hub, capsys):
    assert main(["fetch-model", REPO_ID, "--revision", "main"]) == 0
    assert f"{REPO_ID}@{COMMIT}: downloaded into" in capsys.readouterr().out
    assert main(["fetch-model", REPO_ID, "--revision", "main"]) == 0
    assert f"{REPO_ID}@{COMMIT}: already in" in capsys.readouterr().out
    assert len(hub.downloads) == 1
    # What a server then reads with the network off: the same snapshot.
    files = resolve_model(REPO_ID, "main")
    assert files.revision == COMMIT and (files.directory / "model.safetensors").is_file()


def test_a_gateways_snapshot_without_weights_is_completed_for_a_server(hub):
    files, downloaded = fetch_model(REPO_ID, weights=False)
    assert downloaded and not list(files.directory.glob("*.safetensors"))
    assert "*.safetensors" not in hub.downloads[0][2]
    assert fetch_model(REPO_ID, weights=False)[1] is False
    files, downloaded = fetch_model(REPO_ID)  # a decode pod sharing the volume
    assert downloaded and (files.directory / "model.safetensors").is_file()
    assert len(hub.downloads) == 2


def test_offline_a_cached_model_is_used_and_a_missing_one_refused(hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        fetch_model(REPO_ID)
    assert main(["fetch-model", REPO_ID]) == 2
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err
    monkeypatch.delenv("HF_HUB_OFFLINE")
    fetch_model(REPO_ID, weights=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="lacks model.safetensors.*HF_HUB_OFFLINE"):
        fetch_model(REPO_ID)
    assert fetch_model(REPO_ID, weights=False)[1] is False
    assert len(hub.downloads) == 1


def test_a_path_is_not_fetched(hub, capsys):
    assert main(["fetch-model", "/models/llama"]) == 2
    assert "not a Hugging Face repo id" in capsys.readouterr().err
    assert hub.downloads == []
