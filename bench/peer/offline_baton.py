"""The baton side of the peer benchmark: the engine's own step loop over the workload.

Every request is added at once, then ``Engine.step()`` runs until all finish —
the loop ``baton up``'s decode pod runs — timing each request's first token.
Writes the same JSON result as ``peer_vllm.py``.

``--token-budget`` sets the scheduler's token budget (0: the service's auto budget),
``--max-seqs`` its ``max_running`` (0: the service's default).

usage: offline_baton.py MODEL_DIR WORKLOAD_JSON OUT_JSON --dtype float32 [--token-budget N]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import CpuWindow, run_arguments, wait_for_quiet, write_result


def main() -> None:
    args = run_arguments()
    import torch

    torch.set_num_threads(args.threads)
    from baton.config import KVPoolConfig, SchedulerConfig
    from baton.model import load_checkpoint
    from baton.sampling.params import SamplingParams
    from baton.sarathi.engine import Engine

    workload = json.loads(Path(args.workload).read_text())
    started = time.perf_counter()
    loaded = load_checkpoint(args.model, dtype=args.dtype, device="cpu")
    limits = {"max_running": args.max_seqs} if args.max_seqs else {}
    engine = Engine(loaded.model, loaded.tokenizer,  # the service's defaults but these two
                    scheduler=SchedulerConfig(token_budget=args.token_budget, **limits),
                    kv=KVPoolConfig(prefix_cache=not args.no_prefix_cache))
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=workload["new_tokens"], ignore_eos=True)
    engine.generate([workload["warmup"]], params)  # warm-up
    wait_for_quiet()
    first_token_s: dict[str, float] = {}
    token_ids: dict[str, list[int]] = {}
    with CpuWindow() as window:
        t0 = time.perf_counter()
        order = [engine.add_request(prompt, params) for prompt in workload["prompts"]]
        for request_id in order:
            token_ids[request_id] = []
        while engine.has_unfinished():
            for output in engine.step():
                if output.new_token_ids and output.request_id not in first_token_s:
                    first_token_s[output.request_id] = time.perf_counter() - t0
                token_ids[output.request_id] += output.new_token_ids
    write_result(args.out, "baton", args.dtype, load_s, window,
                 [first_token_s[r] for r in order], [token_ids[r] for r in order],
                 token_budget=engine.scheduler.config.token_budget,
                 max_seqs=engine.scheduler.config.max_running)


if __name__ == "__main__":
    main()
