"""baton's own CPU kernels (``*.cpp`` beside this module), built on first use for this machine.

Where torch's CPU kernels leave much of the hardware idle on the shapes our models
have (small heads), a kernel of ours runs instead; see docs/runtime.md for the
figures. The sources are written over one vector header (``vec.h``: 8 fp32 lanes with
AVX2, 16 with AVX-512) and compiled once per instruction set, one module per build:
``avx2`` (AVX2 and FMA), ``avx512`` (F/BW/DQ/VL) and ``avx512_bf16`` (with AVX512_BF16's
bf16 products); a CPU runs the richest build it can (``build_for_this_cpu()``), and
``Build.kernels`` says what each holds. They are compiled with torch's extension builder
the first time a process needs them (~20-30 s; cached under ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions`` and shared by later processes). An image builds them all once
instead (``build(DIR)``) and points ``BATON_KERNEL_DIR`` at DIR: its pods load the one for
their CPU from there, read-only.

``kernels()`` is None only where no build runs (not x86, or no AVX2) or with
``BATON_CPU_KERNELS=0``; a build that fails (a compiler error, no compiler) raises
KernelBuildError with the compiler's message rather than falling back to torch's kernels.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import re
import subprocess
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent


class KernelBuildError(RuntimeError):
    """A build this CPU needs did not compile or load; the message holds the compiler's."""


@dataclass(frozen=True)
class Build:
    """One instruction set's module: its sources, its flags (which select vec.h's registers),
    the kernels it holds (those not in every build are compiled in by BATON_WITH_<KERNEL>),
    and whether this CPU runs it. The instruction sets are named rather than -march=native,
    so a build is valid on every CPU that has them (a shared cache, an image)."""

    isa: str
    sources: tuple[str, ...]
    flags: tuple[str, ...]
    kernels: tuple[str, ...]
    runs_here: Callable[[], bool] = field(compare=False, repr=False)

    @property
    def compile_flags(self) -> tuple[str, ...]:
        return (*self.flags, *(f"-DBATON_WITH_{kernel.upper()}" for kernel in self.kernels
                               if kernel not in EVERY_BUILD_KERNELS))

    @property
    def name(self) -> str:
        """The module's name, unique to what its objects depend on: these sources, every
        header, the flags, torch's version (its headers) and the interpreter's ABI. Torch
        keeps one build directory per name, so two versions never rebuild each other's,
        while two checkouts of the same sources (a worktree, a fresh clone) share one build,
        as a compiler cache would."""
        digest = hashlib.sha256(repr((self.compile_flags, torch.__version__,
                                      sysconfig.get_config_var("EXT_SUFFIX"))).encode())
        for source in (*self.sources, *sorted(path.name for path in SOURCE_DIR.glob("*.h"))):
            digest.update((SOURCE_DIR / source).read_bytes())
        return f"baton_cpu_{self.isa}_{digest.hexdigest()[:16]}"


EVERY_BUILD_KERNELS = ("causal_attention", "paged_decode_attention", "rms_norm", "silu_and_mul", "rotary_")
_COMMON_FLAGS = ("-O3", "-mfma", "-fno-math-errno", "-fopenmp")
_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", *_COMMON_FLAGS)
# The AVX-512 builds' attention keeps register tiles of scores (tiles.h: 32 registers)
_AVX512_SOURCES = ("causal_attention_tiles.cpp", "decode_attention_tiles.cpp", "attention_scores.cpp",
                   "elementwise.cpp", "bindings.cpp")

# On CPUs with AVX2 and FMA only: attention in loops that fit 16 registers (rows.h), the
# element-wise kernels, and the linear layer over a few rows (where oneDNN's and MKL's kernels
# read the weights slowly); PyramidInfer's scores run on torch's kernels there.
AVX2 = Build("avx2", ("causal_attention_rows.cpp", "decode_attention_rows.cpp", "few_rows_linear.cpp",
                      "elementwise.cpp", "bindings.cpp"),
             ("-mavx2", *_COMMON_FLAGS), (*EVERY_BUILD_KERNELS, "few_rows_linear"),
             runs_here=lambda: torch.cpu._is_avx2_supported())
# AVX-512 without AVX512_BF16 (Intel Xeon, Skylake to Ice Lake): every AVX-512 kernel, bf16
# products on fp32 FMAs; and the few-rows linear layer, which the AVX2 build gave these CPUs.
AVX512 = Build("avx512", (*_AVX512_SOURCES, "few_rows_linear.cpp"), _AVX512_FLAGS,
               (*EVERY_BUILD_KERNELS, "attention_scores", "few_rows_linear"),
               runs_here=lambda: torch.cpu._is_avx512_supported())
# AVX-512 with AVX512_BF16 (bf16 products in hardware).
AVX512_BF16 = Build("avx512_bf16", _AVX512_SOURCES, (*_AVX512_FLAGS, "-mavx512bf16"),
                    (*EVERY_BUILD_KERNELS, "attention_scores"),
                    runs_here=lambda: torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported())
BUILDS = (AVX2, AVX512, AVX512_BF16)  # the plainest first
HEAD_DIMS = (32, 64, 128)
DTYPES = (torch.float32, torch.bfloat16)
MAX_DECODE_GROUP = 16  # query heads per KV head the decode and scores kernels take


def builds_for_this_cpu() -> tuple[Build, ...]:
    """Every build this CPU runs, the plainest first (none: not x86, or no AVX2)."""
    return tuple(each for each in BUILDS if each.runs_here())


def build_for_this_cpu() -> Build | None:
    """The richest build this CPU runs, or None (not x86, or no AVX2)."""
    runnable = builds_for_this_cpu()
    return runnable[-1] if runnable else None


def enabled() -> bool:
    """Has the user left baton's kernels on (``BATON_CPU_KERNELS`` other than 0)?"""
    return os.environ.get("BATON_CPU_KERNELS", "1") != "0"


@functools.cache
def kernels() -> ModuleType | None:
    """The module of this CPU's build (``build_for_this_cpu()``), or None where none runs or
    the user switched them off: ``causal_attention`` (prompts and prefix slices),
    ``paged_decode_attention`` (decode batches), a Llama layer's element-wise steps
    (``rms_norm``, ``silu_and_mul``, ``rotary_``), and as the build has them PyramidInfer's
    ``attention_scores`` and ``few_rows_linear`` (``has()`` tells). Raises KernelBuildError
    when the build fails."""
    chosen = build_for_this_cpu()
    if not enabled() or chosen is None:
        return None
    return load(chosen)


@functools.cache
def has(kernel: str) -> bool:
    """Does this CPU's module hold ``kernel``? (Asked on every layer of every step: cached.)"""
    module = kernels()
    return module is not None and hasattr(module, kernel)


def load(chosen: Build) -> ModuleType:
    """``chosen``'s module: the image's (``BATON_KERNEL_DIR``) where it has one, else compiled
    here (cached). A failure raises KernelBuildError with the compiler's message, on every
    later call too: a process compiles a broken source once, not on every layer that asks."""
    result = _load_once(chosen)
    if isinstance(result, str):
        raise KernelBuildError(result)
    return result


@functools.cache
def _load_once(chosen: Build) -> ModuleType | str:
    """The module, or why it could not be had."""
    prebuilt = Path(os.environ.get("BATON_KERNEL_DIR", "/nonexistent")) / f"{chosen.name}.so"
    try:
        if prebuilt.exists():
            spec = importlib.util.spec_from_file_location(chosen.name, prebuilt)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        return _compile(chosen)
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as error:
        return (f"baton's {chosen.isa} CPU kernels ({chosen.name}) could not be built or loaded: "
                f"{without_progress(str(error))}\n"
                "(fix the source, or install a C++ compiler; BATON_CPU_KERNELS=0 runs torch's kernels instead)")


def without_progress(message: str) -> str:
    """A build's output without ninja's line per command that went well ("[2/6] c++ ..."):
    what stays is the failed command and the compiler's message."""
    return "\n".join(line for line in message.splitlines() if not re.match(r"\[\d+/\d+\] ", line))


def build(directory: str | None = None, builds: tuple[Build, ...] = BUILDS) -> None:
    """Compile ``builds`` (every instruction set's module unless told) into ``directory``, or
    torch's extension cache, so that an image runs its kernels on any x86 CPU it lands on.
    Raises KernelBuildError, with the compiler's message, when one fails."""
    for each in builds:
        if directory is None:
            load(each)  # torch's builder tries a name once a process: a second try reports no error
            continue
        try:
            _compile(each, directory)
        except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as error:
            raise KernelBuildError(f"baton's {each.isa} CPU kernels ({each.name}) failed to build: "
                                   f"{without_progress(str(error))}") from error


def check_compiles(chosen: Build) -> None:
    """Compile each of ``chosen``'s sources to an object with its flags, without linking or
    loading it: a CPU that cannot run a build still finds its compile errors. Remembered per
    build name (its sources, headers and flags) in its build directory; raises
    KernelBuildError with the compiler's message."""
    from torch.utils import cpp_extension

    build_directory = Path(cpp_extension._get_build_directory(chosen.name, verbose=False))
    stamp = build_directory / "compiles.stamp"
    with build_lock(build_directory):
        if stamp.exists():
            return
        includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]

        def compile_one(source: str) -> subprocess.CompletedProcess:
            command = ["c++", "-c", str(SOURCE_DIR / source), "-o", str(build_directory / f"{source}.check.o"),
                       f"-DTORCH_EXTENSION_NAME={chosen.name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                       f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                       *(f"-isystem{path}" for path in includes), "-fPIC", "-std=c++20", *chosen.compile_flags,
                       "-O0"]  # the code generator's checks (an instruction the flags lack) without its time
            return subprocess.run(command, capture_output=True, text=True, check=False)

        # one compiler per core: most of each one's time is parsing torch's headers
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            results = list(pool.map(compile_one, chosen.sources))
        for source, compiled in zip(chosen.sources, results, strict=True):
            if compiled.returncode != 0:
                raise KernelBuildError(f"{source} does not compile for the {chosen.isa} build:\n"
                                       f"{compiled.stdout}{compiled.stderr}")
        stamp.touch()


def _compile(chosen: Build, directory: str | None = None) -> ModuleType:
    from torch.utils import cpp_extension

    # torch's own choice of directory (under $TORCH_EXTENSIONS_DIR or its cache) unless told
    build_directory = Path(directory) if directory is not None else \
        Path(cpp_extension._get_build_directory(chosen.name, verbose=False))
    with build_lock(build_directory), pinned_ninja():
        return cpp_extension.load(name=chosen.name, sources=[str(SOURCE_DIR / s) for s in chosen.sources],
                                  extra_cflags=list(chosen.compile_flags), build_directory=str(build_directory),
                                  verbose=False)


# A build of every kernel takes a minute or two of a busy 2-core machine; a holder this long is stuck.
BUILD_WAIT_S = 600.0


@contextlib.contextmanager
def build_lock(directory: Path, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """Hold a build directory for this process alone, with torch's own lock file cleared.

    torch's builder marks a build (or the up-to-date check every load runs) with a file,
    ``lock``, that its owner deletes when done, and every other loader waits for that file
    to go, without limit. A process killed in between (a chain's rank stopped while it
    loaded its kernels) leaves the file behind, and every later process on the machine
    hung at its start. An flock, which the kernel drops with its holder, guards the
    directory instead: whoever holds it knows any ``lock`` file is a dead process's.
    Waiting longer than ``wait_s`` for a live holder raises TimeoutError."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "baton.flock", "w") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has held {directory} for over {wait_s:g} s") from None
                time.sleep(0.1)  # a build's minute, polled: a blocking flock could not time out
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing %s, left by a process killed while it loaded these kernels", stale)
            stale.unlink(missing_ok=True)
        yield  # closing the handle drops the flock


@contextlib.contextmanager
def pinned_ninja() -> Iterator[None]:
    """Put the ninja baton pins (the ``ninja`` package's) first on PATH while a build runs.

    torch runs whichever ``ninja`` PATH finds, and ninja versions record a build's commands
    differently: with a system ninja first on one caller's PATH (``make run``) and the pinned
    one on another's (an activated virtualenv), each took the other's build for stale and
    compiled every kernel again (a minute of every core, at a pod's start)."""
    try:
        import ninja
    except ImportError:  # not installed with baton: whatever ninja PATH has
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR
    try:
        yield
    finally:
        os.environ["PATH"] = path


def causal_attention_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Can the kernel take these inputs (device, dtype, head size, GQA shape)?"""
    return (q.device.type == "cpu" and q.dtype in DTYPES and k.dtype == q.dtype
            and q.shape[-1] in HEAD_DIMS and q.shape[1] % k.shape[1] == 0
            and not wants_gradient(q, k) and has("causal_attention"))


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [len, heads, dim] as the prompt kernel reads it: each token's heads side by side,
    rows at any stride (a view of a fused q/k/v projection needs no copy); a copy otherwise."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]:
        return x
    return x.contiguous()


def paged_decode_fits(dtype: torch.dtype, device: torch.device, head_dim: int, num_heads: int,
                      num_kv_heads: int) -> bool:
    """Can the decode kernel read a paged cache of this model shape where it lies?"""
    return (torch.device(device).type == "cpu" and dtype in DTYPES and head_dim in HEAD_DIMS
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_DECODE_GROUP
            and has("paged_decode_attention"))


def attention_scores_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Can ``attention_scores`` take recent queries q [R, H, D] over keys k [S, Hkv, D]?"""
    return (k.dtype == q.dtype and not wants_gradient(q, k) and has("attention_scores")
            and paged_decode_fits(q.dtype, q.device, q.shape[-1], q.shape[1], k.shape[1]))


def elementwise_fits(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Can the element-wise kernels take rows of x (a CPU tensor of bf16 or fp32, every
    row's width a multiple of 16; rotary_ and silu_and_mul check their own widths), with
    ``others`` (a weight) beside it?"""
    return (x.device.type == "cpu" and x.dtype in DTYPES and x.dim() == 2
            and x.shape[1] % 16 == 0 and not wants_gradient(x, *others) and has("rms_norm"))


# Up to this many rows the few-rows kernel beats oneDNN's packed one (the shipped model's
# projections, AVX2 EPYC: 3.5-4x at 1 row, 2x at 8, 1.3x at 16, even from 24).
MAX_FEW_ROWS = 16


def few_rows_linear_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Can ``few_rows_linear`` take x [R, in] (R up to MAX_FEW_ROWS, ``in`` a multiple of the
    build's lanes) @ weight.T (+ bias)?"""
    return (x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= MAX_FEW_ROWS
            and x.dtype in DTYPES and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.is_contiguous() and (bias is None or bias.dtype == x.dtype)
            and not wants_gradient(x, weight, *([] if bias is None else [bias]))
            and has("few_rows_linear") and x.shape[1] % kernels().lanes == 0)


def wants_gradient(*tensors: torch.Tensor) -> bool:
    """Would autograd need a backward through a kernel on these? (The kernels have none: a
    forward that trains takes torch's ops.)"""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
