"""The vLLM side of the peer benchmark, run in the peer's own virtualenv (no baton here).

Offline: ``LLMEngine.add_request`` for every request of the workload at once, then
``step()`` until all finish — the same loop as baton's ``Engine.step``, so the first
token's time is seen per request. Writes a JSON result: wall time, generated tokens,
TTFT per request, the token ids, and the CPU time other processes used.

Configured as vLLM's CPU guide says (the caller sets the environment: tcmalloc and Intel
OpenMP preloaded, ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``) and with its
defaults (prefix caching on); ``--token-budget`` sets ``max_num_batched_tokens`` and ``--max-seqs``
``max_num_seqs`` (0: vLLM's defaults).

usage: offline_vllm.py MODEL_DIR WORKLOAD_JSON OUT_JSON --dtype float32 [--token-budget N]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import CpuWindow, run_arguments, wait_for_quiet, write_result


def main() -> None:
    args = run_arguments()  # --threads: the environment's VLLM_CPU_OMP_THREADS_BIND decides
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workload = json.loads(Path(args.workload).read_text())
    started = time.perf_counter()
    # Statistics on: each request's first-token time stamp comes from the engine core, on the
    # system-wide monotonic clock (the client process may pick outputs up later).
    limits = {"max_num_batched_tokens": args.token_budget} if args.token_budget else {}
    if args.max_seqs:
        limits["max_num_seqs"] = args.max_seqs
    if args.no_prefix_cache:
        limits["enable_prefix_caching"] = False
    llm = LLM(model=args.model, dtype=args.dtype, seed=0, disable_log_stats=False, **limits)
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=workload["new_tokens"], ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=workload["warmup"])], params, use_tqdm=False)
    engine = llm.llm_engine
    wait_for_quiet()
    first_token_s: dict[str, float] = {}
    token_ids: dict[str, list[int]] = {}
    with CpuWindow() as window:
        t0 = time.monotonic()
        for index, prompt in enumerate(workload["prompts"]):
            engine.add_request(str(index), TokensPrompt(prompt_token_ids=prompt), params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    token_ids[output.request_id] = list(output.outputs[0].token_ids)
                    first_token_s[output.request_id] = output.metrics.first_token_ts - t0
    order = [str(i) for i in range(len(workload["prompts"]))]
    write_result(args.out, "vllm", args.dtype, load_s, window,
                 [first_token_s[r] for r in order], [token_ids[r] for r in order],
                 token_budget=llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
                 max_seqs=llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)


if __name__ == "__main__":
    main()
