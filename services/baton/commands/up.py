"""`baton up`: the whole service on this machine as separate processes.

    baton up                          gateway + one 2-rank prefill chain + one decode pod
    baton up --decode-workers 2 --listen 127.0.0.1:50051 --http-port 8000
    baton up --demo                   ... then stream a short and a long prompt (`make run`)
    baton up --no-chain-break-even    long prompts go to the chain from the threshold on
    baton up --demo --exit-after-demo for scripts: stop once the demo is shown
    baton up --autoscale --min-decode-pods 1 --max-decode-pods 2 --itl-p90-s 0.05
                                      the planner starts and stops decode pods (its targets
                                      and the live counts on the HTTP API's /metrics)

Routing state must be shared by the processes, so without ``--redis URL`` a private
``redis-server`` is started on a free port and stopped on exit (``make setup`` installs it).
Ctrl-C (or SIGTERM) stops every process; so does any failure during start-up. Once up,
a process that dies is restarted with backoff and the restart is printed
(``LocalCluster.supervise``): the service as a whole keeps serving. Between those, ``baton up``
waits on its children's exits, the back-off deadlines, the planner's next tick and SIGTERM
(``LocalCluster.wait_for_change``), not on a clock. With ``--autoscale``
the operator's planner sizes the decode pods from the pods' own metrics
(``baton.local.autoscaler``); its settings are ``PlannerConfig``'s flags.
Heavy imports happen in ``run`` only.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from baton import configtree
from baton.config import (
    ChainConfig,
    GatewayRoutingConfig,
    HttpConfig,
    KVCacheConfig,
    KVTransportConfig,
    LogConfig,
    OtlpConfig,
    PlannerConfig,
    ServerConfig,
    StreamConfig,
)
from baton.configtree import choices_of

if TYPE_CHECKING:
    from baton.local.spec import ClusterSpec

DEMO_SHORT_PROMPT = "def fibonacci(n):\n"
DEMO_LINES_PER_ROUND = 8  # the long demo prompt grows by this many source lines until long enough
# Nothing is due before a child exits, a back-off or the planner's interval ends, or a stop:
# this bound on a wait is for a wake-up that never came, not a tick.
SUPERVISOR_WAIT_MAX_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", metavar="DIR",
                        help="checkpoint directory for every process (default: the shipped model)")
    parser.add_argument("--revision", default="", help="a repo id's branch, tag or commit")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="the longest sequence served (default: the model's)")
    parser.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                        help="the names clients call the model by (the first is the one "
                             "reported); default: the checkpoint directory's name")
    parser.add_argument("--decode-workers", type=int, default=1, choices=(1, 2),
                        help="decode pods to start")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="shard each decode pod's and each chain rank's model over N "
                             "processes (gloo on a CPU, NCCL on GPUs)")
    parser.add_argument("--prefill-tensor-parallel-size", type=int, default=None, metavar="N",
                        help="the chain ranks' own size (default: --tensor-parallel-size); a "
                             "chain ships every KV head, so it may differ from the decode pods'")
    parser.add_argument("--chain-ranks", type=int, default=ChainConfig.ranks,
                        help="ranks of the one prefill chain (0 = no chain; default: %(default)s)")
    parser.add_argument("--redis", default="", metavar="URL",
                        help="use this Redis for routing (default: start a private redis-server)")
    parser.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT",
                        help="the gateway's address (port 0 = any free port)")
    parser.add_argument("--http-port", type=int, default=HttpConfig.port,
                        help="the gateway's OpenAI-compatible HTTP API on 127.0.0.1 (0 = off; "
                             "default: %(default)s)")
    parser.add_argument("--prefill-threshold-tokens", type=int,
                        default=GatewayRoutingConfig.prefill_threshold_tokens,
                        help="prompts at least this long go through the chain, once they also "
                             "reach its break-even (see --no-chain-break-even; default: "
                             "%(default)s)")
    parser.add_argument("--no-chain-break-even", dest="chain_break_even", action="store_false",
                        help="route by --prefill-threshold-tokens alone; by default the chain takes "
                             "only prompts from the length its partition table measured it to "
                             "beat one process (on one small machine that is past the shipped "
                             "model's context: the processes share the cores)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of every process (default: 1 per chain rank, and "
                             "the decode pods as --decode-threads says)")
    parser.add_argument("--decode-threads", type=int, default=None,
                        help="torch threads of each decode pod (default: --threads when given, "
                             "else this machine's cores shared among the decode pods)")
    parser.add_argument("--stream-interval-ms", type=float, default=StreamConfig.interval_ms,
                        help="the decode pods' --stream-interval-ms: hold each stream's messages "
                             "this far apart, the tokens meanwhile going as one (0 = every step)")
    parser.add_argument("--decode-grace-s", type=float, default=ServerConfig.grace_s,
                        help="seconds a decode pod that is stopped (or retired by --autoscale) "
                             "gives its streams; the gateway moves the unfinished ones to another "
                             "pod by replaying their tokens")
    parser.add_argument("--kv-transport", default=KVTransportConfig.kind,
                        choices=choices_of(KVTransportConfig, "kind"),
                        help="how the chain ships KV to the decode pods: grpc = on the PushKV "
                             "stream; nixl = NIXL (UCX) for the bytes (`make nixl` installs it)")
    parser.add_argument("--demo", action="store_true",
                        help="once up, stream a short and a long prompt and show their routes")
    parser.add_argument("--exit-after-demo", action="store_true",
                        help="with --demo: stop the service after the demo")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per demo generation")
    parser.add_argument("--autoscale", action="store_true",
                        help="start and stop decode pods by the autoscaling planner's decisions "
                             "(--decode-workers is then the count to start with)")
    parser.add_argument("--planner-trace", type=Path, default=None,
                        help="with --autoscale: record every planner step (the series it read, "
                             "the sizes, its decision) to this JSON-lines file, gzipped if it "
                             "ends in .gz, for replaying in tests (baton.planner.trace)")
    configtree.add_arguments(parser.add_argument_group("logs of every process"), LogConfig, "log")
    configtree.add_arguments(parser.add_argument_group("the KV cache of the chains and the decode pods"),
                             KVCacheConfig, "kv_cache")
    configtree.add_arguments(parser.add_argument_group("traces of every process"), OtlpConfig, "otlp")
    configtree.add_arguments(parser.add_argument_group(
        "autoscaling (with --autoscale; baton up keeps its one chain, the planner's prefill "
        "target is only shown)"), PlannerConfig)


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    """The cluster the command line asks for (``--threads`` given alone sets every process)."""
    from baton.local.spec import ClusterSpec

    planner = configtree.from_arguments(args, PlannerConfig) if args.autoscale else None
    decode_workers = args.decode_workers
    if planner is not None:  # start within the planner's bounds
        decode_workers = max(planner.min_decode_pods, min(planner.max_decode_pods, decode_workers))
    return ClusterSpec(model_path=args.model, model_revision=args.revision,
                       max_model_len=args.max_model_len, served_model_names=args.served_model_name,
                       decode_workers=decode_workers,
                       chain_ranks=args.chain_ranks, redis_url=args.redis,
                       gateway_listen=args.listen, gateway_http_port=args.http_port,
                       prefill_threshold_tokens=args.prefill_threshold_tokens,
                       chain_break_even=args.chain_break_even,
                       threads_per_process=1 if args.threads is None else args.threads,
                       decode_threads=next(value for value in (args.decode_threads, args.threads, 0)
                                           if value is not None),
                       stream_interval_ms=args.stream_interval_ms, autoscale=planner,
                       decode_grace_s=args.decode_grace_s, kv_transport=args.kv_transport,
                       decode_tensor_parallel_size=args.tensor_parallel_size,
                       prefill_tensor_parallel_size=(args.tensor_parallel_size
                                                     if args.prefill_tensor_parallel_size is None
                                                     else args.prefill_tensor_parallel_size),
                       log=configtree.from_arguments(args, LogConfig, "log"),
                       kv_cache=configtree.from_arguments(args, KVCacheConfig, "kv_cache"),
                       otlp=configtree.from_arguments(args, OtlpConfig, "otlp"))


def run(args: argparse.Namespace) -> int:
    from baton.local.autoscaler import LocalAutoscaler
    from baton.local.child_exits import StopEvent
    from baton.local.cluster import LocalCluster

    if args.exit_after_demo and not args.demo:
        raise ValueError("--exit-after-demo needs --demo")
    if args.planner_trace is not None and not args.autoscale:
        raise ValueError("--planner-trace needs --autoscale")
    spec = cluster_spec(args)
    stopping = StopEvent()  # SIGTERM's handler sets it; it wakes the supervisor's wait
    previous = signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    autoscaler = None
    try:
        with LocalCluster(spec) as cluster:
            print(f"baton is up: gateway {cluster.gateway_address}, "
                  f"{spec.decode_workers} decode pod(s) of {spec.threads_of('decode')} thread(s), "
                  f"chain of {spec.chain_ranks} ranks of {spec.threads_of('prefill')} thread(s), "
                  f"routing in {cluster.redis_url}", flush=True)
            if spec.decode_tensor_parallel_size > 1 or spec.prefill_tensor_parallel_size > 1:
                print(f"tensor parallelism: each decode pod {spec.decode_tensor_parallel_size} "
                      f"rank(s) of {spec.threads_of('decode')} thread(s), each chain rank "
                      f"{spec.prefill_tensor_parallel_size}", flush=True)
            if spec.chain_ranks:
                print(_chain_routing(cluster.redis_url, spec), flush=True)
            print(f"try: baton generate --server {cluster.gateway_address} \"import os\"", flush=True)
            if cluster.gateway_http_url:
                print(f"OpenAI API: {cluster.gateway_http_url}", flush=True)
            if args.demo:
                _demo(cluster.gateway_address, args.max_tokens, args.prefill_threshold_tokens,
                      pin_chain=spec.chain_ranks > 0)
                if cluster.gateway_http_url:
                    _demo_http(cluster.gateway_http_url, args.max_tokens)
                if args.exit_after_demo:
                    return 0
            autoscaler = (LocalAutoscaler(cluster, trace_path=args.planner_trace)
                          if spec.autoscale else None)
            if autoscaler is not None:
                print(_autoscaling(spec, cluster.gateway_http_url), flush=True)
            print("serving; Ctrl-C stops every process", flush=True)
            while True:
                planner_due_s = (autoscaler.seconds_to_next_tick() if autoscaler is not None
                                 else SUPERVISOR_WAIT_MAX_S)
                cluster.wait_for_change(min(SUPERVISOR_WAIT_MAX_S, planner_due_s), stopping)
                if stopping.is_set():
                    break
                for event in cluster.supervise():
                    print(f"supervisor: {event}", flush=True)
                for event in autoscaler.tick() if autoscaler is not None else ():
                    print(f"autoscaler: {event}", flush=True)
    except KeyboardInterrupt:
        print("\nstopping", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        stopping.close()
        if autoscaler is not None:
            autoscaler.close()
    return 0


def _autoscaling(spec: ClusterSpec, http_url: str) -> str:
    planner = spec.autoscale
    where = (f"; targets on {http_url.removesuffix('/v1')}/metrics (baton_planner_target_replicas, "
             f"baton_replicas)" if http_url else "")
    return (f"autoscaling decode pods between {planner.min_decode_pods} and "
            f"{planner.max_decode_pods} for TTFT P90 {planner.ttft_p90_s:g} s and ITL P90 "
            f"{planner.itl_p90_s:g} s, deciding every {planner.interval_s:g} s{where}")


def _chain_routing(redis_url: str, spec: ClusterSpec) -> str:
    """Which prompts the gateway sends the chain, from the chain's own routing record."""
    from baton.config import GatewayRoutingConfig
    from baton.routing.redis_store import RedisStore

    store = RedisStore(redis_url)
    try:
        heads = [w for w in store.list_workers("prefill") if w.rank == 0]
    finally:
        store.close()
    threshold = spec.prefill_threshold_tokens
    routing = GatewayRoutingConfig(prefill_threshold_tokens=threshold,
                                   chain_break_even=spec.chain_break_even)
    takes_from = routing.chain_takes_from(heads[0].break_even_tokens) if heads else threshold
    if takes_from == threshold:
        return f"the chain takes prompts of {threshold} tokens or more"
    return (f"the chain takes prompts of {takes_from} tokens or more: its measured break-even "
            f"(partition table), past --prefill-threshold-tokens {threshold}; shorter ones are "
            f"prefilled on the decode pod unless pinned (--no-chain-break-even: from {threshold})")


def _demo(address: str, max_tokens: int, threshold_tokens: int, pin_chain: bool) -> None:
    """The short prompt as the gateway routes it; the long one pinned to the chain when there
    is one (``prefill_route`` chain), so the demo shows both paths whatever the break-even."""
    import sys
    import time

    from baton.api.requests import GenerateRequest
    from baton.client import BatonClient, Completion
    from baton.sampling.params import SamplingParams

    client = BatonClient(address)
    client.wait_until_serving(timeout_s=60)
    long_prompt = _long_prompt(client, threshold_tokens, max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    demos = (("short prompt", DEMO_SHORT_PROMPT, "auto"),
             ("long prompt, pinned to the chain" if pin_chain else "long prompt", long_prompt,
              "chain" if pin_chain else "auto"))
    try:
        for label, prompt, prefill_route in demos:
            num_tokens = len(client.tokenize(prompt).token_ids)
            print(f"\n=== {label}: {num_tokens} tokens; prompt ends with {prompt[-60:]!r}", flush=True)
            completion, start_s = Completion(), time.monotonic()
            request = GenerateRequest(text=prompt, sampling=params, prefill_route=prefill_route)
            for step in client.stream(request):
                completion.add(step, time.monotonic(), start_s)
                sys.stdout.write(step.text)
                sys.stdout.flush()
            route = completion.last.route
            path = (f"prefill chain {route.chain_id} (slices {list(route.partition)}) -> decode pod "
                    f"{route.decode_address}" if route.chain_id
                    else f"prefilled on decode pod {route.decode_address}")
            usage = completion.last.usage
            print(f"\n--- TTFT {completion.ttft_s * 1000:.0f} ms, {len(completion.token_ids)} tokens "
                  f"in {completion.last.timings.total_s:.2f} s; path: {path}; "
                  f"KV shipped {usage.kv_bytes_shipped / 1e6:.2f} MB\n--- why: {route.reason}",
                  flush=True)
    finally:
        client.close()


def _demo_http(base_url: str, max_tokens: int) -> None:
    """The short prompt again through the OpenAI HTTP API, then the curl line that did it."""
    import json
    import urllib.request

    body = json.dumps({"prompt": DEMO_SHORT_PROMPT, "max_tokens": max_tokens, "temperature": 0})
    request = urllib.request.Request(f"{base_url}/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    choice = answer["choices"][0]
    print(f"\n=== OpenAI API: POST {base_url}/completions -> {choice['finish_reason']} after "
          f"{answer['usage']['completion_tokens']} tokens (path: {answer['baton']['route']['path']})",
          flush=True)
    print(DEMO_SHORT_PROMPT + choice["text"], flush=True)
    print(f"try: curl {base_url}/completions -H 'Content-Type: application/json' -d '{body}'",
          flush=True)


def _long_prompt(client, threshold_tokens: int, max_tokens: int) -> str:
    """Source-like text of at least the chain threshold, within the model's context."""
    limit = client.list_models()[0].max_model_len
    if threshold_tokens + max_tokens > limit:
        raise ValueError(f"--prefill-threshold-tokens {threshold_tokens} + --max-tokens {max_tokens} "
                         f"exceed the model's context of {limit} tokens: no demo prompt fits")
    text, num_lines = "", 0
    while len(client.tokenize(text).token_ids) < threshold_tokens:
        text += "".join(f"def step_{i}(state):\n    return state + {i}\n"
                        for i in range(num_lines, num_lines + DEMO_LINES_PER_ROUND))
        num_lines += DEMO_LINES_PER_ROUND
    return text
