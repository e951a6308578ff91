"""No Docker engine runs here: check what can be checked without building the image."""

from __future__ import annotations

import fnmatch
import re
import tomllib

from baton.model.hub import SHIPPED_MODEL_DIR
from baton_operator import workloads
from chart_render import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions(name: str) -> list[str]:
    """Each `name` instruction's arguments, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return re.findall(rf"^{name}\s+(.+)$", joined, flags=re.MULTILINE)


def _copied() -> list[str]:
    sources = []
    for line in _instructions("COPY"):
        sources += line.split()[:-1]
    return sources


def test_every_copied_path_exists_and_is_not_dockerignored():
    ignored = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    for source in _copied():
        assert (ROOT / source).exists(), f"COPY {source}: no such path"
        assert not any(fnmatch.fnmatch(source.rstrip("/"), p) for p in ignored), source


def test_the_shipped_model_and_the_package_are_in_the_image():
    copied = [s.rstrip("/") for s in _copied()]
    assert SHIPPED_MODEL_DIR.relative_to(ROOT).parts[0] in copied
    for package_root in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
            "setuptools"]["packages"]["find"]["where"]:
        assert package_root in copied


def test_entrypoint_is_baton_and_user_is_not_root():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert _instructions("ENTRYPOINT") == ['["baton"]'] and "baton" in scripts
    (user,) = _instructions("USER")
    assert user == "${UID}:${UID}"
    assert f"ARG UID={workloads.RUN_AS_USER}" in DOCKERFILE  # the pods' runAsUser


def test_cpu_and_cuda_bases_by_build_argument():
    assert DOCKERFILE.index("ARG BASE_IMAGE=") < DOCKERFILE.index("FROM ${BASE_IMAGE}")
    assert "ARG TORCH_INDEX_URL=" in DOCKERFILE
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_version = re.search(r"ARG TORCH_VERSION=(\S+)", DOCKERFILE)[1]
    assert f"torch=={torch_version}" in pinned


def test_torch_source_is_a_build_argument_with_the_cpu_index_by_default():
    # `make image TORCH_WHEELS=DIR` sets TORCH_FIND_LINKS; users get the CPU index.
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in DOCKERFILE
    assert re.search(r"^ARG TORCH_FIND_LINKS=$", DOCKERFILE, flags=re.MULTILINE)
    install = " ".join(_instructions("RUN"))
    assert "pip install --index-url ${TORCH_INDEX_URL} torch==${TORCH_VERSION}" in install
    assert ("pip install --no-index --no-deps --find-links ${TORCH_FIND_LINKS} "
            "torch==${TORCH_VERSION}") in install


def test_redis_server_is_installed_for_baton_up():
    # `baton up` starts its own redis-server (local/cluster.py, ManagedRedis).
    (system_packages, *_) = _instructions("RUN")
    assert "command -v redis-server" in system_packages
    assert 'packages="$packages redis-server"' in system_packages
    assert "apt-get install -y --no-install-recommends $packages" in system_packages
