"""One rank of a long-lived prefill chain: join the group, then serve request after request.

The loop reads as verbs: rank 0 takes the next request from its source and
broadcasts a header (operation, request id, mode, partition) and
the token ids, then the request's details (opaque bytes only the tail reads: what the
service needs to ship the result); every rank computes its slice with ``baton.model.prefill`` over
a chain transport (``RunaheadKV`` or ``AllGatherKV``); the tail hands the
result to its sink. While idle, rank 0 broadcasts a keepalive every quarter of
the timeout, so an idle chain never trips the backend's timeout and a dead
peer is noticed even between requests.

Seams for the services built on top: a ``RequestSource`` feeds rank 0 (a
queue from the parent here, gRPC in the prefill service), a ``ChainSink``
takes the tail's result and any rank's failure (a queue back to the parent
here, a KV push to a decode pod in the service), and ``make_observer(C)``
builds the tail's compression hook: an ``AttentionObserver`` with a
``compress(layers) -> layers`` method (PyramidInfer) applied before delivery.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from baton.config import ChainConfig
from baton.kv import LayerKV
from baton.model import prefill
from baton.model.forward_batch import AttentionObserver
from baton.parallel.gathered_kv import GatheredKV
from baton.parallel.leader import start_group
from baton.runahead.errors import ChainError
from baton.runahead.request import MODES, ChainRequest, ChainResult, ModelSource
from baton.runahead.transport import AllGatherKV, RankCounters, RunaheadKV

OP_STOP, OP_KEEPALIVE, OP_PREFILL = 0, 1, 2
HEADER_FIELDS = 5  # op, request id, mode, return_kv, details length; then the p+1 boundaries


class StopChain(Exception):
    """Raised by a ``RequestSource`` when the chain should shut down."""


class RequestSource(Protocol):
    def next_request(self, timeout_s: float) -> ChainRequest | None:
        """The next validated request, None if none came within ``timeout_s``; raises StopChain."""
        ...


class CompressingObserver(AttentionObserver, Protocol):
    def compress(self, layers: list[LayerKV]) -> list[LayerKV]:
        ...


class ChainSink(Protocol):
    def ready(self) -> None:
        """Every rank has joined and loaded its model (called by rank 0)."""

    def deliver(self, result: ChainResult) -> None:
        """The tail's result of one request."""

    def fail(self, rank: int, request_id: int, message: str) -> None:
        """A rank gives up; the chain is broken after this."""


def resolve_device(backend: str, rank: int = 0) -> torch.device:
    """CUDA for NCCL (or auto with a GPU): one GPU per rank, round-robin over the visible ones
    (a pod sees exactly one; a local chain on a multi-GPU machine spreads over them)."""
    if backend == "nccl" or (backend == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def local_backend(requested: str, ranks: int) -> str:
    """The backend for a chain of ``ranks`` processes on this one machine.

    NCCL needs a GPU per rank (it refuses two ranks on one device), so ``auto`` picks it
    only when this machine has a GPU for every rank, and gloo on the CPU otherwise: a
    2-rank chain on a one-GPU workstation runs, on the CPU, instead of failing to form.
    (In a cluster every rank is a pod with a GPU of its own, and ``auto`` means NCCL.)
    """
    if requested != "auto":
        return requested
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if gpus >= ranks else "gloo"


class ChainRank:
    """This process's rank: joins the group and loads the model on construction; ``serve()`` loops."""

    def __init__(self, config: ChainConfig, model_source: ModelSource, sink: ChainSink,
                 source: RequestSource | None = None,
                 make_observer: Callable[[int], CompressingObserver] | None = None,
                 cpu_threads: int = 1, gather_counters: bool = False,
                 on_layer: Callable[[int, LayerKV], None] | None = None,
                 on_computed: Callable[[bytes, float, float, tuple[int, int]], None] | None = None,
                 tensor_parallel_size: int = 1) -> None:
        """``gather_counters``: collect every rank's byte and work counters at the tail with
        each result (one collective per request: for benchmarks and tests, not serving).
        ``on_layer(l, kv)``: the tail's whole cache of each layer but the last, as soon as
        the layer is done (its keys are in, and its attention has been observed), while the
        next one computes; the last comes with the result. ``on_computed(details, began_s,
        ended_s, (start, end))``: this rank is done with a request (monotonic times from its
        header's arrival, and the slice of the prompt it computed), for its trace.
        ``tensor_parallel_size``: this rank's model sharded over that many processes of its
        own, which it leads (``baton.parallel``); its chain exchanges every head."""
        assert (source is not None) == (config.rank == 0), "rank 0, and only rank 0, has a source"
        self.config = config
        self.gather_counters = gather_counters
        self.header_received_ns = 0  # this rank's clock when the request's header arrived
        self.sink = sink
        self.source = source
        self.make_observer = make_observer
        self.on_layer = on_layer
        self.on_computed = on_computed
        self.request_id = -1
        self.details = b""  # the current request's details (ChainRequest.details)
        self.pending: ChainRequest | None = None  # rank 0: the request being broadcast
        self._init_device(cpu_threads)
        self._init_group()
        self._init_model(model_source, tensor_parallel_size, cpu_threads)

    def _init_model(self, model_source: ModelSource, tensor_parallel_size: int,
                    cpu_threads: int) -> None:
        self.followers = None
        if tensor_parallel_size == 1:
            self.model = model_source.load(self.device)
        else:
            if model_source.preset:
                raise ValueError("a chain rank under tensor parallelism loads a checkpoint, "
                                 f"not the preset {model_source.preset!r}")
            loaded, self.followers = start_group(
                tensor_parallel_size, model_source.path, model_source.dtype, self.device.type,
                max_model_len=model_source.max_model_len, backend=self.config.backend,
                timeout_s=self.config.timeout_s, cpu_threads=cpu_threads, with_tokenizer=False)
            self.model, self.device = loaded.model, loaded.model.device
        dist.barrier()  # nobody times a request while a peer is still loading

    def _init_device(self, cpu_threads: int) -> None:
        self.device = resolve_device(self.config.backend, self.config.rank)
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads)

    def _init_group(self) -> None:
        backend = self.config.backend
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=self.config.timeout_s)
        listen_fd = None
        if self.config.rank == 0:
            # torch's own rendezvous store listens on every interface; this one listens on
            # rank 0's address only (the chain's peers are the only ones meant to reach it).
            # The store owns the socket from here on (it closes it): Python lets go of it.
            listen_fd = socket.create_server((self.config.master_addr, self.config.master_port),
                                             backlog=self.config.ranks * 16).detach()
        store = dist.TCPStore(self.config.master_addr, self.config.master_port, self.config.ranks,
                              is_master=self.config.rank == 0, timeout=timeout,
                              master_listen_fd=listen_fd)
        dist.init_process_group(backend, store=store, rank=self.config.rank,
                                world_size=self.config.ranks, timeout=timeout,
                                device_id=self.device if self.device.type == "cuda" else None)

    @property
    def is_tail(self) -> bool:
        return self.config.rank == self.config.ranks - 1

    def serve(self) -> None:
        """Loop until rank 0's source stops; a failure is reported to the sink and re-raised."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread: serve may run off the building one
        if self.config.rank == 0:
            self.sink.ready()
        try:
            while True:
                header, token_ids = self._next_request()
                if header[0] == OP_STOP:
                    break
                if header[0] == OP_PREFILL:
                    self._run(header, token_ids)
        except ChainError as e:  # names the ranks involved already
            self.sink.fail(self.config.rank, self.request_id, str(e))
            raise
        except Exception as e:
            self.sink.fail(self.config.rank, self.request_id, f"rank {self.config.rank}: {e!r}")
            raise
        finally:
            if self.followers is not None:
                self.followers.close()
        dist.destroy_process_group()

    def _next_request(self) -> tuple[list[int], torch.Tensor | None]:
        """Rank 0 reads its source and broadcasts; the others receive the header, the ids and
        the details."""
        header = torch.zeros(HEADER_FIELDS + self.config.ranks + 1, dtype=torch.int64,
                             device=self.device)
        if self.config.rank == 0:
            header[:] = self._encode_header()
        self._broadcast(header, "the next request's header")
        # Every rank has the header once the broadcast returns: the tail times the chain's
        # prefill from here on its own clock (clocks of different hosts do not compare).
        self.header_received_ns = time.monotonic_ns()
        values = header.tolist()
        if values[0] != OP_PREFILL:
            return values, None
        self.request_id = values[1]
        token_ids = torch.empty(values[-1], dtype=torch.int64, device=self.device)
        if self.config.rank == 0:
            token_ids.copy_(self.pending.token_ids)
        self._broadcast(token_ids, f"the token ids of request {self.request_id}")
        self.details = self._broadcast_details(values[4])
        return values, token_ids

    def _broadcast_details(self, length: int) -> bytes:
        if not length:
            return b""
        details = torch.empty(length, dtype=torch.uint8, device=self.device)
        if self.config.rank == 0:
            details.copy_(torch.frombuffer(bytearray(self.pending.details), dtype=torch.uint8))
        self._broadcast(details, f"the details of request {self.request_id}")
        return details.cpu().numpy().tobytes()

    def _encode_header(self) -> torch.Tensor:
        padding = [0] * (self.config.ranks + 1)
        try:
            request = self.source.next_request(self.config.timeout_s / 4)
        except StopChain:
            return torch.tensor([OP_STOP, 0, 0, 0, 0] + padding)
        if request is None:
            return torch.tensor([OP_KEEPALIVE, 0, 0, 0, 0] + padding)
        self.pending = request
        return torch.tensor([OP_PREFILL, request.request_id, MODES.index(request.mode),
                             int(request.return_kv), len(request.details)] + request.boundaries)

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        try:
            dist.broadcast(tensor, src=0)
        except RuntimeError as e:
            raise ChainError(f"rank {self.config.rank}: broadcast of {what} from rank 0 failed "
                             f"(a rank is gone or stuck): {e}") from e

    def _run(self, header: list[int], token_ids: torch.Tensor) -> None:
        """Compute this rank's slice of one request; the tail delivers the result."""
        _, request_id, mode_index, return_kv, _ = header[:HEADER_FIELDS]
        boundaries = header[HEADER_FIELDS:]
        mode = MODES[mode_index]
        config = self.model.config
        transport = (RunaheadKV if mode == "runahead" else AllGatherKV)(
            self.config.rank, boundaries, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, self.model.dtype, self.device)
        transport.post_receives()
        start, end = transport.start, transport.end
        observer = self.make_observer(end) if self.is_tail and self.make_observer else None
        logits = None
        if end > start:
            kv = _LayerTap(transport, self.on_layer) if self.is_tail and self.on_layer else transport
            if self.followers is not None:  # the transport holds every head
                kv = GatheredKV(kv, self.model.head_gather, self.followers.group)
            logits = prefill(self.model, token_ids[start:end],
                             torch.arange(start, end, device=self.device), kv,
                             observer=observer, want_logits=self.is_tail)
        else:
            transport.pass_through()
        if self.is_tail:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the logits exist, not just their kernels
            ttft_s = (time.monotonic_ns() - self.header_received_ns) / 1e9
        transport.finish()
        if self.on_computed is not None:
            self.on_computed(self.details, self.header_received_ns / 1e9, time.monotonic(),
                             (start, end))
        counters = self._gather_counters(transport.counters) if self.gather_counters else []
        if not self.is_tail:
            return
        layers = None
        if return_kv:
            layers = transport.layers()
            if observer is not None:
                layers = observer.compress(layers)
        self.sink.deliver(ChainResult(request_id, logits.cpu(), layers, boundaries, mode, ttft_s,
                                      counters, self.details))

    def _gather_counters(self, counters: RankCounters) -> list[RankCounters]:
        """Every rank's counters, collected at the tail (others get an empty list)."""
        local = torch.tensor(counters.as_list(), dtype=torch.int64, device=self.device)
        tail = self.config.ranks - 1
        gathered = [torch.empty_like(local) for _ in range(self.config.ranks)] if self.is_tail else None
        try:
            dist.gather(local, gathered, dst=tail)
        except RuntimeError as e:
            raise ChainError(f"rank {self.config.rank}: counter exchange with the tail "
                             f"(rank {tail}) failed: {e}") from e
        return [RankCounters(*row.tolist()) for row in gathered] if self.is_tail else []


class _LayerTap:
    """The tail's chain transport, telling ``on_layer`` of each layer but the last once it is
    done: when the next layer stores its keys, the previous one's attention (and so its
    observed scores) is complete."""

    def __init__(self, transport: RunaheadKV | AllGatherKV,
                 on_layer: Callable[[int, LayerKV], None]) -> None:
        self._transport = transport
        self._on_layer = on_layer

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        if layer > 0:
            self._on_layer(layer - 1, self._transport.cache[layer - 1])
        return self._transport.extend(layer, k, v, positions)
