"""`baton generate`: generate text locally on the SARATHI engine.

    baton generate --model DIR "def fib(n):"              streams text to the terminal
    baton generate --prompt-ids 1,2,3 --max-tokens 8 --temperature 0 --json
                                                          {"token_ids": [...], "text": "..."}

Several prompts run batched (continuous batching); with ``--json`` each prints
one line, in the order given (text prompts first, then each ``--prompt-ids``).
``--chain-ranks P`` prefills each prompt through a local KV-Runahead chain of P
processes and decodes from the KV it hands over. Heavy imports (torch, the
model) happen only in ``run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from baton.config import KVCacheConfig, KVPoolConfig, ModelSourceConfig, SchedulerConfig
from baton.configtree import add_arguments as add_config_arguments
from baton.configtree import choices_of, from_arguments


def _token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from e


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="text prompts")
    parser.add_argument("--model", default="", metavar="DIR_OR_REPO",
                        help="a Hugging Face checkpoint directory or repo id (default: the "
                             "shipped model)")
    parser.add_argument("--revision", default="", help="a repo id's branch, tag or commit")
    parser.add_argument("--prompt-ids", action="append", type=_token_ids, default=[],
                        metavar="IDS", help="a prompt as comma-separated token ids (repeatable)")
    # Unset sampling flags take SamplingParams' defaults (the API's), read in `run` (torch);
    # only the temperature differs: a terminal command is greedy unless asked.
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens to generate per prompt (default: the API's)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=None, help="0 = off (default)")
    parser.add_argument("--top-p", type=float, default=None, help="1 = off (default)")
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    parser.add_argument("--json", action="store_true",
                        help='print {"token_ids": [...], "text": "..."} per prompt, one line each')
    parser.add_argument("--dtype", choices=choices_of(ModelSourceConfig, "dtype"),
                        default=os.environ.get("BATON_MODEL_DTYPE", ModelSourceConfig.dtype),
                        help="compute dtype (as --model-dtype of the services; env BATON_MODEL_DTYPE)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="shard the model over N local processes (one per device; gloo on a "
                             "CPU, NCCL on GPUs), rank 0 running the engine")
    parser.add_argument("--chain-ranks", type=int, default=0, metavar="P",
                        help="prefill through a local KV-Runahead chain of P processes (0 = off)")
    parser.add_argument("--server", default="", metavar="HOST:PORT",
                        help="generate on a running baton gateway instead of locally")
    parser.add_argument("--api-key", default=os.environ.get("BATON_API_KEY", ""),
                        help="with --server: the gateway's API key (default: $BATON_API_KEY)")
    parser.add_argument("--tls-ca", default="", metavar="FILE",
                        help="with --server: the gateway serves TLS; its certificate's CA (PEM)")
    add_config_arguments(parser, SchedulerConfig, "scheduler")
    add_config_arguments(parser, KVPoolConfig, "kv")
    add_config_arguments(parser, KVCacheConfig, "kv_cache")


def run(args: argparse.Namespace) -> int:
    prompts = list(args.prompts) + list(args.prompt_ids)
    if not prompts:
        raise ValueError("give at least one PROMPT or --prompt-ids")
    if args.chain_ranks < 0:
        raise ValueError(f"--chain-ranks must be >= 0, got {args.chain_ranks}")
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    from baton.sampling.params import SamplingParams

    given = {"max_tokens": args.max_tokens, "top_k": args.top_k, "top_p": args.top_p}
    params = SamplingParams(temperature=args.temperature, seed=args.seed, stop=args.stop,
                            ignore_eos=args.ignore_eos,
                            **{name: value for name, value in given.items() if value is not None})
    if args.server:
        return _generate_on_server(args, prompts, params)
    if args.tls_ca:
        raise ValueError("--tls-ca applies with --server only")
    from baton.dtypes import dtype_name
    from baton.model.loader import load_checkpoint
    from baton.sarathi.engine import Engine

    followers = None
    if args.tensor_parallel_size > 1:
        from baton.parallel.leader import start_group

        loaded, followers = start_group(args.tensor_parallel_size, args.model, args.dtype,
                                        revision=args.revision)
    else:
        loaded = load_checkpoint(args.model, dtype=args.dtype, revision=args.revision)
    try:
        engine = Engine(loaded.model, loaded.tokenizer,
                        scheduler=from_arguments(args, SchedulerConfig, "scheduler"),
                        kv=from_arguments(args, KVPoolConfig, "kv"),
                        kv_cache=from_arguments(args, KVCacheConfig, "kv_cache"))
        if args.chain_ranks:
            request_ids = _add_chain_prefilled(engine, loaded.path, prompts, params, args.chain_ranks,
                                               dtype_name(loaded.model.dtype))
        else:
            request_ids = [engine.add_request(prompt, params) for prompt in prompts]
        results = _drive(engine, request_ids, stream=not args.json and len(prompts) == 1)
    finally:
        if followers is not None:
            followers.close()
    if args.json:
        for request_id in request_ids:
            token_ids, text = results[request_id]
            print(json.dumps({"token_ids": token_ids, "text": text}))
    elif len(prompts) > 1:
        for index, request_id in enumerate(request_ids):
            print(f"--- [{index}] {prompts[index]!r}")
            print(results[request_id][1])
    return 0


def _generate_on_server(args: argparse.Namespace, prompts: list, params) -> int:
    """``--server HOST:PORT``: the same prompts and output contract, generated by a gateway."""
    local_only = [flag for flag, used in (("--model", args.model), ("--chain-ranks", args.chain_ranks),
                                          ("--ignore-eos", args.ignore_eos)) if used]
    if local_only:
        raise ValueError(f"{', '.join(local_only)} apply to local runs only; the server at "
                         f"{args.server} has its own model and routing")
    from baton.client import BatonClient, generate_to_terminal

    client = BatonClient(args.server, api_key=args.api_key or None, tls_ca_file=args.tls_ca or None)
    return generate_to_terminal(client, prompts, params, as_json=args.json)


def _add_chain_prefilled(engine, model_dir, prompts, params, ranks: int, dtype: str) -> list[str]:
    from baton.runahead.local import prefill_with_local_chain

    request_ids = []
    for prompt in prompts:
        prompt_ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        result = prefill_with_local_chain(str(model_dir), prompt_ids, ranks, dtype=dtype)
        request_ids.append(engine.add_prefilled_request(prompt_ids, result.layers,
                                                        result.first_token_logits, params))
    return request_ids


def _drive(engine, request_ids: list[str], stream: bool) -> dict[str, tuple[list[int], str]]:
    """Step the engine until every request finishes; with ``stream``, print text as it comes."""
    results: dict[str, tuple[list[int], str]] = {rid: ([], "") for rid in request_ids}
    pending = set(request_ids)
    while pending:
        for output in engine.step():
            token_ids, text = results[output.request_id]
            results[output.request_id] = (token_ids + output.new_token_ids, text + output.text_delta)
            if stream:
                sys.stdout.write(output.text_delta)
                sys.stdout.flush()
            if output.finished:
                pending.discard(output.request_id)
    if stream:
        sys.stdout.write("\n")
    return results
