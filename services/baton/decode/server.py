"""`baton decode`: the decode pod's gRPC server, from configuration to a serving process.

Start-up order, each step observable from outside: the gRPC server binds and answers health
NOT_SERVING (and every call UNAVAILABLE) -> the model loads and the engine loop starts ->
the pod registers in the routing store (its heartbeat carries the live load) -> health
turns SERVING. A graceful stop runs it backwards: leave routing, refuse new calls
(UNAVAILABLE), give in-flight streams ``server.grace_s`` to finish, stop the engine loop.
An engine step stuck for ``scheduler.step_stall_s`` (``baton.decode.watchdog``) fails the
pod's streams, leaves routing, refuses new calls and exits with ``EXIT_ENGINE_STALLED``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry

from baton import tracing
from baton.api.v1 import decode_pb2
from baton.compute_thread import build_on_short_lived_thread
from baton.config import DecodeServiceConfig
from baton.config.model import served_model_names
from baton.decode.door import open_door
from baton.decode.servicer import DecodeServicer
from baton.decode.watchdog import EngineWatchdog
from baton.decode.worker import DecodeWorker
from baton.kv.contract import compression_of
from baton.logs import configure_logging
from baton.metrics import DecodeMetrics, serve_metrics
from baton.model.loader import load_checkpoint
from baton.parallel.leader import start_group
from baton.pyramid.engine_hook import engine_compressor_factory
from baton.routing import Heartbeat, RoutingStore, WorkerInfo, open_store
from baton.routing.prefix_index import PrefixPublisher
from baton.sarathi.engine import Engine
from baton.security.mtls import Mtls
from baton.serving import (
    AsyncGrpcServer,
    listen_host,
    new_incarnation,
    release_version,
    run_until_signalled,
)
from baton.transfer import framing
from baton.transfer.nixl import NixlReader
from baton.transfer.planes import open_plane
from baton.transfer.receiver import Incarnation, NixlPlane, kv_spec

log = logging.getLogger(__name__)

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
EXIT_ENGINE_STALLED = 75  # EX_TEMPFAIL: start it again
# The most a stalled pod's gRPC server waits for its calls (the streams just failed) to end
# on its way out, so that their statuses reach the gateway before the process ends.
STALLED_EXIT_GRACE_S = 1.0
STALLED_LEAVE_S = 5.0  # the most the health status change may take on the way out


def exit_stalled_process() -> None:
    """End the process now: its engine thread is stuck and cannot be joined."""
    logging.shutdown()
    os._exit(EXIT_ENGINE_STALLED)


class DecodeServer:
    def __init__(self, config: DecodeServiceConfig, store: RoutingStore | None = None,
                 exit_process: Callable[[], None] | None = None) -> None:
        """``exit_process`` ends the process once a stuck engine was found (tests record it);
        None: ``_stop_and_exit``."""
        self.config = config
        self.exit_process = exit_process or self._stop_and_exit
        self.store = store or open_store(config.routing)
        self.registry = CollectorRegistry()  # the metrics join it once the model is loaded
        self.mtls = Mtls(config.mtls)
        transport = config.kv_transport
        agent = open_plane(transport.kind, "decode", listen_host(config.server.listen))
        nixl = (NixlPlane(NixlReader(agent), transport.nixl_read_timeout_s)
                if agent is not None else None)
        self.servicer = DecodeServicer(config.kv.max_pending_pushes, self.mtls,
                                       config.stream.interval_ms / 1000, nixl)
        self.grpc = AsyncGrpcServer(config.server, self._register, [SERVICE_NAME],
                                    self.mtls.server_credentials() if self.mtls.enabled else None,
                                    ping_callers=True)
        self.port, self.address = self.grpc.port, self.grpc.address
        self.incarnation = new_incarnation()
        self._stop_metrics = serve_metrics(config.server.metrics_host, config.server.metrics_port,
                                           self.registry, lambda: self.grpc.serving)
        self._init_worker()
        self.heartbeat = Heartbeat(self.store, self.describe, config.routing.heartbeat_s,
                                   config.routing.worker_ttl_s).start()
        self.watchdog = (EngineWatchdog(self.worker, config.scheduler.step_stall_s,
                                        self._engine_stalled).start()
                         if config.scheduler.step_stall_s else None)
        self._init_door()
        self.grpc.set_serving(True)

    def _init_door(self) -> None:
        """The pod's own OpenAI door when asked (``http.port``): an InferencePool endpoint."""
        self.door = self.door_router = None
        self.http_port = 0
        if not self.config.http.port:
            return
        self.door, self.door_router = open_door(self.config, self.store, self.servicer,
                                                self.describe, self.metrics,
                                                ready=lambda: self.grpc.serving)
        self.http_port = self.grpc.call(self.door.start())

    def _register(self, server) -> None:
        framing.add_decode_servicer(self.servicer, server)  # PushKV's chunks without copies

    def _init_worker(self) -> None:
        model = self.config.model
        if model.threads:
            torch.set_num_threads(model.threads)

        def build() -> Engine:
            self.loaded = self._load()
            engine = Engine(self.loaded.model, self.loaded.tokenizer,
                            scheduler=self.config.scheduler, kv=self.config.kv,
                            compressor_factory=engine_compressor_factory(self.config.pyramid,
                                                                         self.loaded.config),
                            model_revision=self.loaded.revision, kv_cache=self.config.kv_cache)
            check_pool_holds_a_sequence(engine, explicit_blocks=self.config.kv.num_blocks > 0)
            capture_decode_graphs(engine)
            return engine

        # Only the engine thread may keep an OpenMP pool (see baton.compute_thread).
        engine = build_on_short_lived_thread(build, "decode-load")
        self.metrics = DecodeMetrics(self.registry,
                                     served_model_names(model, self.loaded.model_id)[0])
        self.worker = DecodeWorker(engine, self.address, self.metrics,
                                   lease_s=self.config.kv.unclaimed_lease_s,
                                   max_queued_requests=self.config.server.max_queued_requests,
                                   on_group_down=self.exit_process)
        self.worker.start()
        # what this pod takes from a chain (its pool's storage dtype and scale): checked on
        # every push, and published whole with the routing record so that gateways pair it
        # only with chains that ship it
        storage = engine.pool.storage
        self.kv_spec = kv_spec(self.loaded.config, self.loaded.model_id, self.loaded.revision,
                               storage.name, storage.scale)
        self.kv_contract = dataclasses.replace(
            self.kv_spec.contract, compression=compression_of(self.config.pyramid),
            block_size=engine.pool.block_size, tensor_parallel_size=self.config.tensor_parallel.size)
        self.prefix_publisher = None
        if engine.pool.prefix_cache is not None:  # what it caches, for cache-aware routing
            self.prefix_publisher = PrefixPublisher(self.store, self.describe_identity().prefix_stream,
                                                    self.config.routing.prefix_ttl_s).start()
            self.worker.report.prefix_publisher = self.prefix_publisher
        self.servicer.ready(self.worker, self.kv_spec, self.grpc.loop, Incarnation(self.address, self.incarnation))
        log.info("decode pod %s serves %s (revision %s), %d KV blocks, token budget %d (%s)",
                 self.address, self.loaded.model_id, self.loaded.revision, engine.pool.num_blocks,
                 engine.scheduler.config.token_budget,
                 "timed at start" if self.config.scheduler.token_budget == 0 else "set")

    def _load(self):
        """The model, or with ``tensor_parallel.size`` > 1 rank 0's shard of it, the other
        ranks started as this pod's processes (``baton.parallel.leader``)."""
        model, parallel = self.config.model, self.config.tensor_parallel
        self.followers = None
        if parallel.size == 1:
            return load_checkpoint(model.path, dtype=model.dtype, device=model.device,
                                   revision=model.revision, max_model_len=model.max_model_len)
        loaded, self.followers = start_group(parallel.size, model.path, model.dtype, model.device,
                                             model.revision, model.max_model_len, parallel.backend,
                                             parallel.timeout_s, model.threads)
        return loaded

    def describe(self) -> WorkerInfo:
        """This pod's routing record with its live load (called by every heartbeat)."""
        return dataclasses.replace(self.describe_identity(), load=self.worker.load)

    def describe_identity(self) -> WorkerInfo:
        """This pod's routing record without its load."""
        pool = self.worker.engine.pool
        return WorkerInfo(worker_id=f"decode-{self.address}", role="decode", address=self.address,
                          model_id=self.loaded.model_id, model_revision=self.loaded.revision,
                          version=release_version(), kv_dtype=self.kv_spec.dtype,
                          incarnation=self.incarnation,
                          kv_block_size=pool.block_size if pool.prefix_cache is not None else 0,
                          kv_transport=self.config.kv_transport.kind, kv_contract=self.kv_contract)

    def _engine_stalled(self) -> None:
        """The watchdog's verdict (its streams are failed already): leave routing, refuse new
        calls, exit (whatever of the first three fails or hangs: they are bounded)."""
        try:
            self.heartbeat.stop()
            self.servicer.drain()
            self.grpc.call(self.grpc.set_serving_async(False), timeout_s=STALLED_LEAVE_S)
        except Exception:
            log.exception("leaving routing after a stuck engine step failed")
        finally:
            self.exit_process()

    def _stop_and_exit(self) -> None:
        """Stop the gRPC server once its calls ended (``STALLED_EXIT_GRACE_S`` at most: the
        failed streams' statuses go out first), then end the process."""
        try:
            self.grpc.stop(STALLED_EXIT_GRACE_S)
        except Exception:
            log.exception("stopping the gRPC server of a stalled pod failed")
        finally:
            exit_stalled_process()

    def stop(self, grace_s: float | None = None) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.heartbeat.stop()
        if self.prefix_publisher is not None:
            self.prefix_publisher.stop()
        self.servicer.drain()
        if self.door is not None:  # the door's streams drain beside the gRPC calls
            self.grpc.stop(grace_s, cleanup=self.door_router.close, alongside=self.door.stop)
        else:
            self.grpc.stop(grace_s)
        self.worker.stop()
        if self.followers is not None:
            self.followers.close()
        if self._stop_metrics is not None:
            self._stop_metrics()


def check_pool_holds_a_sequence(engine: Engine, explicit_blocks: bool = False) -> None:
    """Log the pool's size; refuse to start when one sequence of the longest length served
    cannot fit (ValueError naming both), or only warn when the block count was set by hand
    (``kv.num_blocks``: a deliberate small pool, whose long requests wait or are refused)."""
    pool, max_len = engine.pool, engine.model.config.max_position_embeddings
    holds = engine.memory.capacity_tokens()
    log.info("KV pool: %d blocks of %d tokens (%.0f MiB); one sequence holds up to %d tokens, "
             "max_model_len %d", pool.num_blocks, pool.block_size,
             pool.num_blocks * pool.bytes_per_block / 2**20, holds, max_len)
    if holds < max_len:
        message = (f"the KV pool holds {holds} tokens of one sequence, fewer than max_model_len "
                   f"{max_len}: give the pool more memory (kv.memory_mib, kv.memory_fraction) or "
                   f"lower model.max_model_len")
        if not explicit_blocks:
            raise ValueError(message)
        log.warning("%s (kv.num_blocks was set: starting anyway)", message)


def capture_decode_graphs(engine: Engine) -> None:
    """On a GPU, every decode step's CUDA graph before the pod serves (none is captured in
    the middle of a stream, where it would hold up every sequence of that step)."""
    graphs = engine.runner.graphs
    if graphs is None:
        return
    started = time.monotonic()
    count = graphs.capture_all()
    if graphs.enabled:
        log.info("captured %d CUDA graphs of decode steps in %.1f s", count, time.monotonic() - started)


def create_server(config: DecodeServiceConfig, store: RoutingStore | None = None,
                  exit_process: Callable[[], None] | None = None) -> tuple[DecodeServer, int]:
    """A started, SERVING decode server (``server.listen`` may name port 0) and its port."""
    server = DecodeServer(config, store, exit_process)
    return server, server.port


def serve(config: DecodeServiceConfig) -> int:
    """Run until SIGTERM/SIGINT, then stop gracefully."""
    configure_logging(config.log)
    Mtls(config.mtls).check_service("decode")
    tracing.configure(config.otlp, "baton-decode")
    try:
        server, _ = create_server(config)
        run_until_signalled(server.stop)
    finally:
        tracing.shutdown()
    return 0
