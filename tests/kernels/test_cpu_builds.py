"""Every build compiles here, whether or not this CPU runs it (a broken AVX-512 source fails on
an AVX2 machine too); a CPU runs the richest build it can, which holds the kernels its Build
names; and a source that does not compile fails with the compiler's message instead of
falling back to torch's kernels."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from baton.kernels import cpu as cpu_kernels

BROKEN_SOURCE = "int broken() { return undeclared_name; }\n"


# A build not in the cache takes minutes of a busy 2-core machine (the suite's limit is 300 s).
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("build", cpu_kernels.BUILDS, ids=lambda build: build.isa)
def test_every_build_compiles_here(build):
    if build in cpu_kernels.builds_for_this_cpu():
        module = cpu_kernels.load(build)
        functions = {name for name in dir(module) if not name.startswith("_") and callable(getattr(module, name))}
        assert functions == set(build.kernels)
        assert module.lanes == (8 if build is cpu_kernels.AVX2 else 16)
    else:  # objects only: this CPU could not load the module
        cpu_kernels.check_compiles(build)


@pytest.mark.parametrize(("avx512", "bf16", "expected"), [
    (False, False, ("avx2",)),  # an AVX2-only EPYC
    (True, False, ("avx2", "avx512")),  # an Intel Xeon with AVX-512 but no BF16 (issue 57)
    (True, True, ("avx2", "avx512", "avx512_bf16")),  # an AVX-512 EPYC with BF16
])
def test_a_cpu_runs_every_build_its_instructions_allow_and_loads_the_richest(monkeypatch, avx512, bf16, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    assert tuple(each.isa for each in cpu_kernels.builds_for_this_cpu()) == expected
    assert cpu_kernels.build_for_this_cpu().isa == expected[-1]


def test_without_avx2_there_is_no_build_and_torchs_kernels_serve(monkeypatch):
    for check in ("_is_avx2_supported", "_is_avx512_supported", "_is_avx512_bf16_supported"):
        monkeypatch.setattr(torch.cpu, check, lambda: False)
    assert cpu_kernels.builds_for_this_cpu() == () and cpu_kernels.kernels.__wrapped__() is None


def broken_build(tmp_path: Path, monkeypatch) -> cpu_kernels.Build:
    """A build of one source that does not compile, in a build cache of its own."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    source = tmp_path / "broken.cpp"
    source.write_text(BROKEN_SOURCE)
    return cpu_kernels.Build("broken", (str(source),), ("-O0",), (), runs_here=lambda: True)


def test_a_source_that_does_not_compile_fails_with_the_compilers_message(tmp_path, monkeypatch):
    broken = broken_build(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_kernels, "build_for_this_cpu", lambda: broken)
    with pytest.raises(cpu_kernels.KernelBuildError, match="undeclared_name"):
        cpu_kernels.kernels.__wrapped__()
    with pytest.raises(cpu_kernels.KernelBuildError, match="undeclared_name"):
        cpu_kernels.build(builds=(broken,))
    with pytest.raises(cpu_kernels.KernelBuildError, match="undeclared_name"):
        cpu_kernels.check_compiles(broken)
    monkeypatch.setenv("BATON_CPU_KERNELS", "0")  # unless the user asks for torch's kernels
    assert cpu_kernels.kernels.__wrapped__() is None


def test_an_image_loads_its_prebuilt_module(tmp_path):
    from torch.utils import cpp_extension

    chosen = cpu_kernels.build_for_this_cpu()
    if chosen is None:
        pytest.skip("no build runs on this CPU (no AVX2)")
    cpu_kernels.load(chosen)  # built (or found) in torch's cache
    built = Path(cpp_extension._get_build_directory(chosen.name, verbose=False)) / f"{chosen.name}.so"
    image = tmp_path / "image"
    image.mkdir()
    shutil.copy(built, image / built.name)
    # a pod: no build cache, and a compiler that fails at once were it asked
    env = {**os.environ, "BATON_KERNEL_DIR": str(image), "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"),
           "CXX": "false", "PYTHONPATH": str(Path(cpu_kernels.__file__).resolve().parents[2])}
    loaded = subprocess.run([sys.executable, "-c", "from baton.kernels import cpu; print(cpu.kernels().__file__)"],
                            env=env, capture_output=True, text=True, timeout=120, check=False)
    assert loaded.returncode == 0, loaded.stderr
    assert Path(loaded.stdout.strip()) == image / built.name
