"""A model named by its Hugging Face repo id, found in a Hugging Face cache directory this
test lays out as huggingface_hub lays it out (refs/, snapshots/), with the network off
(HF_HUB_OFFLINE): served and generated from like the directory itself, under the repo id,
its KV labelled with the snapshot's commit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import huggingface_hub
import pytest
from baton.config import ModelSourceConfig
from baton.gateway.served_model import ServedModel
from baton.model.errors import CheckpointError
from baton.model.hub import is_repo_id, resolve_model
from commands.cli_checkpoint import save_cli_checkpoint

REPO_ID = "acme/tiny-coder"
COMMIT = "3f2a9c0d" * 5


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """(the cache directory, the checkpoint directory it holds a snapshot of)."""
    checkpoint = save_cli_checkpoint(tmp_path_factory.mktemp("checkpoint"))
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    shutil.copytree(checkpoint, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache, checkpoint


@pytest.fixture
def offline_cache(hub_cache, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def test_a_repo_id_resolves_to_its_cached_snapshot_at_main_or_at_its_commit(offline_cache):
    _, checkpoint = offline_cache
    for revision in ("", "main", COMMIT):
        files = resolve_model(REPO_ID, revision)
        assert files.name == REPO_ID and files.revision == COMMIT
        assert (files.directory / "config.json").read_text() == (checkpoint / "config.json").read_text()
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache .* at revision v2.*HF_HUB_OFFLINE"):
        resolve_model(REPO_ID, "v2")
    with pytest.raises(CheckpointError, match="acme/missing: snapshot is not in the Hugging Face cache"):
        resolve_model("acme/missing")


def test_a_directory_stays_a_directory_and_is_called_by_its_name(offline_cache, tmp_path):
    _, checkpoint = offline_cache
    files = resolve_model(str(checkpoint))
    assert files.directory == checkpoint and files.name == checkpoint.name
    assert not is_repo_id(str(checkpoint)) and is_repo_id(REPO_ID) and is_repo_id("gpt2")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model(str(tmp_path / "absent" / "model"))


def test_the_gateway_serves_a_repo_id_under_its_name(offline_cache):
    served = ServedModel.load(ModelSourceConfig(path=REPO_ID))
    assert served.info.id == REPO_ID and served.info.revision == COMMIT
    served.check_name(REPO_ID)


def test_baton_generate_by_repo_id_equals_by_directory_with_the_network_off(hub_cache):
    cache, checkpoint = hub_cache
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}

    def generate(model: str) -> dict:
        completed = subprocess.run(
            [sys.executable, "-m", "baton.cli", "generate", "--model", model, "--prompt-ids",
             "1,2,3", "--max-tokens", "6", "--temperature", "0", "--json"],
            capture_output=True, text=True, timeout=120, check=False, env=env)
        assert completed.returncode == 0, completed.stderr
        return json.loads(completed.stdout)

    assert generate(REPO_ID) == generate(str(checkpoint))
