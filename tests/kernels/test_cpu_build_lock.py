"""A process killed while it loads the kernels never stalls the processes after it.

torch's builder marks every load with a ``lock`` file its owner deletes when done, and
later loaders wait for it without limit; ``build_lock`` keeps a dead process's file from
stopping anyone (a chain rank killed as it started once left every later pod on the machine
hung at its start)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from baton.kernels import cpu as cpu_kernels

SERVICES = str(Path(cpu_kernels.__file__).resolve().parents[2])
# A process that takes the directory's lock, says so, and holds it until it dies.
HOLDER = ("import sys, time; from pathlib import Path; from baton.kernels.cpu import build_lock\n"
          "with build_lock(Path(sys.argv[1])):\n"
          "    print('held', flush=True); time.sleep(600)\n")


def python(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SERVICES}
    return subprocess.Popen([sys.executable, *args], env=env, text=True, **kwargs)


def test_a_lock_file_left_by_a_dead_loader_is_removed_and_a_live_holder_is_waited_for(tmp_path):
    (tmp_path / "lock").touch()  # what torch's builder leaves when its process is killed
    with cpu_kernels.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()

    holder = python("-c", HOLDER, str(tmp_path), stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=str(tmp_path)), cpu_kernels.build_lock(tmp_path, wait_s=0.5):
            pass
        assert time.monotonic() - started >= 0.5
        # the holder dies holding it (SIGKILL: no cleanup runs); the next taker goes on at once
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        with cpu_kernels.build_lock(tmp_path, wait_s=5):
            pass
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()


@pytest.mark.skipif(cpu_kernels.build_for_this_cpu() is None, reason="no build runs on this CPU (no AVX2)")
def test_a_process_loads_its_kernels_past_a_lock_file_a_killed_one_left():
    from torch.utils import cpp_extension

    chosen = cpu_kernels.build_for_this_cpu()
    stale = Path(cpp_extension._get_build_directory(chosen.name, verbose=False)) / "lock"
    stale.touch()
    try:
        loader = python("-c", "from baton.kernels.cpu import kernels; print(kernels() is not None)",
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = loader.communicate(timeout=120)  # torch alone waits here forever
        finally:
            loader.kill()
        assert out.strip() == "True", err
        assert "removing" in err and not stale.exists()
    finally:
        stale.unlink(missing_ok=True)
