"""`baton prefill`: one rank of a KV-Runahead prefill chain as a process.

Every rank runs the same command with its own ``--chain-rank``. Rank 0 binds the Prefill
gRPC service first (health NOT_SERVING, calls UNAVAILABLE), then joins the chain; once every
rank has joined and loaded its model the chain turns rank 0 SERVING and registers it in the
routing store (role prefill, the chain id, its queued work). The other ranks serve no gRPC:
they join, loop on the chain's broadcasts and stop when rank 0 does. The last rank is the
tail (``TailSink``): it ships each cache to the decode pod the request names. With one rank,
rank 0 is also the tail.

A broken chain is not repaired in place: rank 0 fails the requests in flight (UNAVAILABLE),
leaves routing and exits non-zero, so that its pod restarts with the others.
"""

from __future__ import annotations

import logging
import threading

import torch
from prometheus_client import CollectorRegistry

from baton import tracing
from baton.api.v1 import prefill_pb2, prefill_pb2_grpc
from baton.compute_thread import build_on_short_lived_thread
from baton.config import PrefillServiceConfig
from baton.config.model import served_model_names
from baton.errors import PermissionDenied
from baton.kv.contract import HEADS_COMPLETE, KVContract, compression_of
from baton.kv.storage import KVStorage, kv_storage
from baton.logs import configure_logging
from baton.metrics import PrefillMetrics, serve_metrics
from baton.model.hub import resolve_model
from baton.prefill.frontend import PrefillFrontend
from baton.prefill.tail import TailSink
from baton.routing import Heartbeat, RoutingStore, RoutingView, WorkerInfo, open_store
from baton.runahead.break_even import Link, kv_bytes_per_token
from baton.runahead.request import ModelSource
from baton.runahead.table import PartitionTable
from baton.runahead.worker import ChainRank
from baton.sampling.grammars import ModelGrammars
from baton.security.mtls import Mtls
from baton.serving import (
    AsyncGrpcServer,
    listen_host,
    new_incarnation,
    release_version,
    run_until_signalled,
)
from baton.transfer.planes import open_plane

log = logging.getLogger(__name__)

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class RankSink:
    """A rank that is not the tail: reports readiness and failure, delivers nothing."""

    def __init__(self, on_ready=lambda: None, on_fail=lambda message: None) -> None:
        self.on_ready = on_ready
        self.on_fail = on_fail

    def ready(self) -> None:
        self.on_ready()

    def deliver(self, result) -> None:
        raise AssertionError("only the tail delivers results")

    def fail(self, rank: int, request_id: int, message: str) -> None:
        log.error("prefill chain broken at rank %d: %s", rank, message)
        self.on_fail(message)


class PrefillServer:
    """This process's rank; constructing it joins the chain (blocks until every rank has)."""

    def __init__(self, config: PrefillServiceConfig, store: RoutingStore | None = None) -> None:
        self.incarnation = new_incarnation()
        self.config = config
        chain = config.chain
        self.is_head, self.is_tail = chain.rank == 0, chain.rank == chain.ranks - 1
        self.model_source = ModelSource(path=config.model.path, dtype=config.model.dtype,
                                        max_model_len=config.model.max_model_len)
        self.model_config = self.model_source.config()
        files = resolve_model(config.model.path, config.model.revision)
        self.model_id, self.revision = files.name, files.revision
        self.registry = CollectorRegistry()
        self.metrics = PrefillMetrics(self.registry, served_model_names(config.model, files.name)[0])
        self.mtls = Mtls(config.mtls)
        self.broken = threading.Event()  # the chain failed or stopped: the process should end
        self.heartbeat: Heartbeat | None = None
        self.store = store
        self._stop_metrics = serve_metrics(config.server.metrics_host, config.server.metrics_port,
                                           self.registry, self._ready if self.is_head else None)
        if self.is_head:
            self._init_frontend()
        self._init_chain()

    def _init_frontend(self) -> None:
        table = None
        if self.config.chain.ranks > 1:
            table = PartitionTable.load(self.config.chain.partition_table)
            if self.config.chain.ranks not in table.ranks():
                log.warning("partition table %s has no entries for %d ranks: even slices",
                            table.name, self.config.chain.ranks)
                table = None
        self.table = table
        self.frontend = PrefillFrontend(self.model_config, self.model_id,
                                        self.config.chain.ranks, self.config.chain.mode, table,
                                        self.metrics, self.config.chain.timeout_s,
                                        self.config.server.max_queued_requests, self.mtls)
        self.grpc = AsyncGrpcServer(self.config.server, self._register, [SERVICE_NAME],
                                    self.mtls.server_credentials() if self.mtls.enabled else None,
                                    ping_callers=True)
        self.port, self.address = self.grpc.port, self.grpc.address

    def _ready(self) -> bool:
        """Rank 0 is ready while its gRPC health is SERVING (the whole chain joined)."""
        grpc_server = getattr(self, "grpc", None)
        return grpc_server is not None and grpc_server.serving

    def _register(self, server) -> None:
        prefill_pb2_grpc.add_PrefillServicer_to_server(self.frontend, server)

    @property
    def by_layer(self) -> bool:
        return self.config.chain.kv_shipping == "by-layer"

    def _init_chain(self) -> None:
        on_ready = self._on_ready if self.is_head else (lambda: None)
        on_fail = self._on_fail
        if self.is_tail:
            self.sink = TailSink(self.model_config, self.model_id, self.revision,
                                 self.config.pyramid, self.metrics, lambda: self.rank.details,
                                 on_ready, on_fail, self.mtls, self.by_layer,
                                 self._kv_storage,
                                 nixl=open_plane(self.config.kv_transport.kind, "prefill",
                                                 listen_host(self.config.server.listen)),
                                 kv_device=lambda: self.rank.model.device,
                                 grammars=ModelGrammars(self.model_source.tokenizer,
                                                        self.model_config.vocab_size,
                                                        self.model_config.eos_token_ids))
        else:
            self.sink = RankSink(on_ready, on_fail)
        def build() -> ChainRank:
            return ChainRank(self.config.chain, self.model_source, self.sink,
                             source=self.frontend if self.is_head else None,
                             make_observer=self.sink.make_observer if self.is_tail else None,
                             cpu_threads=self.config.model.threads or 1,
                             on_layer=self.sink.on_layer if self.is_tail and self.by_layer else None,
                             on_computed=self._trace_slice if tracing.enabled() else None,
                             tensor_parallel_size=self.config.tensor_parallel.size)

        # Rank 0 serves its chain on a thread of its own (the main thread waits for signals):
        # it loads on a short-lived one, so only the serving thread keeps an OpenMP pool
        # (see baton.compute_thread). The other ranks load and serve on the main thread.
        self.rank = build_on_short_lived_thread(build, "prefill-load") if self.is_head else build()

    def _trace_slice(self, details: bytes, began_s: float, ended_s: float,
                     prompt_slice: tuple[int, int]) -> None:
        """This rank's span of a traced request: from its header's broadcast to its part done
        (the KV of the ranks before it received, its slice computed, its KV sent on)."""
        request = prefill_pb2.PrefillRequest.FromString(details)
        if request.traceparent:
            chain = self.config.chain
            tracing.record("baton.prefill.rank", request.traceparent, began_s, ended_s,
                           {"baton.request_id": request.request_id, "baton.chain": chain.chain_id,
                            "baton.rank": chain.rank, "baton.slice.start": prompt_slice[0],
                            "baton.slice.end": prompt_slice[1]})

    def _kv_storage(self) -> KVStorage:
        """What this chain ships keys and values as (the model's once it is loaded)."""
        return kv_storage(self.config.kv_cache.dtype, self.config.kv_cache.scale,
                          self.rank.model.dtype)

    def _on_ready(self) -> None:
        # Advertised to the gateways (0: not measured here; the threshold alone decides).
        self.break_even_tokens = (self._break_even(self.table) if self.table is not None else 0)
        storage = self._kv_storage()
        self.kv_dtype = storage.name
        model = self.model_config
        # What this chain ships, for the gateways to pair it only with decode pods that take it
        self.kv_contract = KVContract(self.model_id, self.revision, dtype=self.kv_dtype,
                                      kv_scale=storage.scale,
                                      num_layers=model.num_hidden_layers,
                                      num_kv_heads=model.num_key_value_heads,
                                      head_dim=model.head_dim, layout=HEADS_COMPLETE,
                                      compression=compression_of(self.config.pyramid))
        self.store = self.store or open_store(self.config.routing)
        self.frontend.check_decode = DecodePods(RoutingView(self.store, self.config.routing.view_refresh_s),
                                                self.model_id).check
        self.frontend.unavailable = None
        self.heartbeat = Heartbeat(self.store, self.describe, self.config.routing.heartbeat_s,
                                   self.config.routing.worker_ttl_s).start()
        self.grpc.set_serving(True)
        log.info("prefill chain %s of %d ranks serving at %s", self.config.chain.chain_id,
                 self.config.chain.ranks, self.address)

    def _break_even(self, table: PartitionTable) -> int:
        """From which prompt length this chain's route gives the first token sooner than the
        decode pod's own prefill: the table's measured compute, plus shipping the KV the
        deployment's compression keeps over the configured link (``baton.runahead.break_even``)."""
        chain, pyramid, model = self.config.chain, self.config.pyramid, self.model_config
        element_bytes = torch.empty(0, dtype=self.rank.model.dtype).element_size()
        kv_per_token = kv_bytes_per_token(model.num_hidden_layers, model.num_key_value_heads,
                                          model.head_dim, element_bytes,
                                          pyramid.keep_ratio if pyramid.enabled else 1.0)
        link = Link(chain.kv_link_gb_per_s * 1e9, chain.extra_hop_ms / 1e3)
        return table.break_even(chain.ranks, self.rank.device.type, kv_per_token, link)

    def _on_fail(self, message: str) -> None:
        if self.is_head:
            self.grpc.set_serving(False)
            self.frontend.fail_all(message)
        self.broken.set()

    def describe(self) -> WorkerInfo:
        chain = self.config.chain
        return WorkerInfo(worker_id=f"prefill-{chain.chain_id}", role="prefill",
                          address=self.address, model_id=self.model_id,
                          model_revision=self.revision, version=release_version(),
                          chain_id=chain.chain_id, rank=0, num_ranks=chain.ranks,
                          load=self.frontend.load, kv_dtype=self.kv_dtype,
                          break_even_tokens=self.break_even_tokens, incarnation=self.incarnation,
                          kv_contract=self.kv_contract)

    def serve_chain(self) -> None:
        """The chain loop (rank 0: in a thread beside gRPC; other ranks: the main thread)."""
        try:
            self.rank.serve()
        finally:
            self.broken.set()

    def stop(self, grace_s: float | None = None) -> None:
        """Rank 0: leave routing, finish in-flight calls, then stop the whole chain."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.is_head:
            self.grpc.stop(grace_s)
            self.frontend.stop_chain()
        if self._stop_metrics is not None:
            self._stop_metrics()


class DecodePods:
    """The decode pods a chain may push KV to: those registered in the routing store."""

    def __init__(self, view: RoutingView, model_id: str) -> None:
        self.view = view
        self.model_id = model_id

    def check(self, address: str) -> None:
        """PermissionDenied unless a live decode pod of this model is registered at
        ``address``: a caller cannot make the chain connect anywhere else."""
        for fresh in (False, True):  # a pod that registered since the last read
            if any(worker.address == address and worker.model_id == self.model_id
                   for worker in self.view.snapshot(fresh).of_role("decode")):
                return
        raise PermissionDenied(f"decode_address {address!r} is not a decode pod of {self.model_id!r} "
                               f"in the routing store: this chain pushes KV only to those")


def serve(config: PrefillServiceConfig) -> int:
    configure_logging(config.log)
    Mtls(config.mtls).check_service("prefill")
    tracing.configure(config.otlp, "baton-prefill", **{"baton.chain": config.chain.chain_id,
                                                       "baton.rank": config.chain.rank})
    try:
        return _serve(config)
    finally:
        tracing.shutdown()


def _serve(config: PrefillServiceConfig) -> int:
    server = PrefillServer(config)
    if not server.is_head:
        try:
            server.serve_chain()
        except Exception:  # noqa: BLE001 - reported to the sink and logged; the exit code says it
            return 1
        return 0
    failed = []

    def chain_loop() -> None:
        try:
            server.serve_chain()
        except Exception as e:  # noqa: BLE001 - the chain is broken; the process must end
            failed.append(e)

    thread = threading.Thread(target=chain_loop, name="prefill-chain", daemon=True)
    thread.start()
    run_until_signalled(server.stop, server.broken)
    thread.join(config.chain.timeout_s)
    return 1 if failed else 0
