"""`baton up --demo --exit-after-demo`: the whole service comes up as processes, streams a
short prompt through a decode pod and a long one through the chain, answers the short one
again over the OpenAI HTTP API, and leaves nothing running behind it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.runahead.table import PartitionTable
from baton.serving import free_port
from redis_server import redis_server_binary

pytestmark = pytest.mark.slow


def test_up_demo_shows_both_paths_and_stops_every_process():
    if redis_server_binary() is None or not (SHIPPED_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("needs redis-server and the shipped model")
    completed = subprocess.run(
        [sys.executable, "-m", "baton.cli", "up", "--demo", "--exit-after-demo",
         "--listen", "127.0.0.1:0", "--http-port", str(free_port()), "--max-tokens", "8",
         "--prefill-threshold-tokens", "200"],
        capture_output=True, text=True, timeout=240, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    output = completed.stdout
    local, chained = re.findall(r"--- TTFT (\d+) ms, (\d+) tokens .*; path: (.*);", output)
    assert local[2].startswith("prefilled on decode pod") and int(local[1]) > 0
    assert chained[2].startswith("prefill chain chain-0 (slices [0, ") and int(chained[1]) > 0
    # the short prompt as routed; the long one pinned to the chain (its break-even is past
    # the shipped model's context on this table)
    break_even = PartitionTable.load().min_context[2]
    assert f"the chain takes prompts of {break_even} tokens or more: its measured break-even" in output
    short_why, long_why = re.findall(r"--- why: (.*)", output)
    assert re.fullmatch(r"prompt of \d+ tokens < prefill_threshold_tokens 200: prefilled on the "
                        r"decode pod", short_why)
    assert long_why == "prefill_route chain: chain chain-0"
    assert re.search(r"=== OpenAI API: POST http://127\.0\.0\.1:\d+/v1/completions -> length after "
                     r"8 tokens \(path: local\)", output), output
    assert "try: curl http://127.0.0.1:" in output
    # Every child named the private Redis on its command line; none may outlive the command,
    # nor may that redis-server (its title shows its port).
    redis_url = re.search(r"routing in (redis://127\.0\.0\.1:(\d+)/0)", output)
    leftovers = [cmdline for cmdline in _command_lines()
                 if redis_url.group(1) in cmdline
                 or ("redis-server" in cmdline and f":{redis_url.group(2)}" in cmdline)]
    assert not leftovers


def _command_lines() -> list[str]:
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
    return lines
