"""`baton gateway`: the client-facing gRPC server and, beside it on the same event loop, the
OpenAI-compatible HTTP API (``create_server`` for tests, ``serve`` for the command).

The gateway registers itself in the routing store with role ``gateway`` (its advertised
address and model), refreshed by heartbeat like every worker, so ``baton up`` and the
operator can find it, and reads the workers through a ``RoutingView`` that keeps the last
view while the store is down. Its health is SERVING only while that view holds a live
decode pod: a load balancer sends clients only to gateways that can serve them. A graceful stop turns health NOT_SERVING, refuses new
Generate calls with UNAVAILABLE and gives in-flight streams ``server.grace_s``.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from prometheus_client import CollectorRegistry

from baton import tracing
from baton.api.v1 import api_pb2, api_pb2_grpc
from baton.config import GatewayServiceConfig
from baton.gateway.channels import Channels
from baton.gateway.generations import Generations
from baton.gateway.http import OpenAIServer
from baton.gateway.http.chat_template import ChatTemplate
from baton.gateway.relay import Relay
from baton.gateway.request_table import RequestTable
from baton.gateway.routing_policy import create_policy
from baton.gateway.served_model import ServedModel
from baton.gateway.servicer import BatonServicer
from baton.logs import configure_logging
from baton.metrics import GatewayMetrics, serve_metrics
from baton.routing import Heartbeat, RoutingStore, RoutingView, WorkerInfo, open_store
from baton.routing.prefix_index import PrefixIndex
from baton.security.api_keys import ApiKeys
from baton.security.mtls import Mtls
from baton.serving import AsyncGrpcServer, new_incarnation, release_version, run_until_signalled

log = logging.getLogger(__name__)

# The routing store cannot notify: a decode pod that registers or expires is seen at the next
# read of it, this long after the last one. One reader for the gateway: its readiness, and
# the requests that wait for a live pod, look at what each read found.
VIEW_READ_S = 0.25
READER_STOP_S = 5.0  # the most a stop waits for the view reader to end


class GatewayServer:
    """A started gateway: its gRPC server, its registration and its downstream channels."""

    def __init__(self, config: GatewayServiceConfig, store: RoutingStore | None = None) -> None:
        self.config = config
        self.incarnation = new_incarnation()
        self.store = store if store is not None else open_store(config.routing)
        self.model = ServedModel.load(config.model)
        self.metrics = GatewayMetrics(CollectorRegistry(), self.model.info.id)
        self.channels = Channels(Mtls(config.mtls))
        self.generations = Generations(
            model=self.model,
            view=RoutingView(self.store, config.routing.view_refresh_s, prefixes=PrefixIndex()),
            policy=create_policy(config.gateway, self.model.model_id,
                                 self.metrics.kv_contract_mismatches.inc),
            table=RequestTable(self.store, config.routing.request_ttl_s),
            relay=Relay(self.channels, self.model.model_id, config.gateway,
                        self.metrics),
            metrics=self.metrics)
        self.keys = ApiKeys(config.auth.api_keys_file)
        self.servicer = BatonServicer(self.generations, self.keys, config.gateway.stall_s)
        self.ready = False  # a request could be routed now (SERVING)
        self.grpc = AsyncGrpcServer(config.server, self._register,
                               [api_pb2.DESCRIPTOR.services_by_name["Baton"].full_name])
        self.address = self.grpc.address
        self.port = self.grpc.port
        self.http: OpenAIServer | None = None
        self.http_port = 0
        if config.http.port:
            self.http = OpenAIServer(
                config.http, self.generations, self.keys,
                ChatTemplate.from_dir(self.model.directory), self.metrics.registry,
                ready=lambda: self.ready, max_streams=config.server.max_streams,
                max_body_bytes=config.server.max_message_mib << 20, stall_s=config.gateway.stall_s)
            try:
                self.http_port = self.grpc.call(self.http.start())
            except BaseException:
                self.grpc.stop(0)
                raise
        self.heartbeat = Heartbeat(self.store, self._describe, config.routing.heartbeat_s,
                                   config.routing.worker_ttl_s).start()
        self._stop_metrics = serve_metrics(config.server.metrics_host, config.server.metrics_port,
                                           self.metrics.registry, lambda: self.grpc.serving)
        self._draining = asyncio.Event()  # set by stop(): health is the drain's from then on
        self._health = asyncio.Lock()  # held while the view reader updates health
        self._stopped = asyncio.Event()  # set once the server has stopped: the reader ends
        self._reader = self.grpc.call(self._start_reading_the_view())

    async def _start_reading_the_view(self):
        return asyncio.ensure_future(self._read_the_view())

    async def _read_the_view(self) -> None:
        """The view reader: reads the routing store every ``VIEW_READ_S`` until the gateway's
        server has stopped and wakes the requests that wait for a live pod at each read (they
        may wait through a drain: a stream whose pod died moves on). Until the drain begins it
        also keeps health SERVING while the view holds a live decode pod of the model (a
        gateway with nobody to send work to is not ready), NOT_SERVING otherwise."""
        loop = asyncio.get_running_loop()
        serving = None
        while not self._stopped.is_set():
            snapshot = await loop.run_in_executor(None, self.generations.view.snapshot)
            self.generations.look_again()
            async with self._health:
                if not self._draining.is_set():  # what was read must not undo NOT_SERVING
                    ready = bool(self.generations.policy.decode_workers(snapshot))
                    self.ready = ready
                    if ready != serving:
                        await self.grpc.set_serving_async(ready)
                        if serving is not None:
                            log.info("gateway %s", "ready again" if ready
                                     else "has no live decode pod: NOT_SERVING")
                        serving = ready
            try:
                await asyncio.wait_for(self._stopped.wait(), VIEW_READ_S)
            except TimeoutError:
                pass

    async def _begin_drain(self) -> None:
        """No health update of the view reader lands after this (the drain turns health
        NOT_SERVING next), and requests waiting for a pod to be admitted give up now."""
        self._draining.set()
        async with self._health:  # an update in progress ends first
            pass
        self.generations.look_again()

    async def _after_stop(self) -> None:
        self._stopped.set()  # a store read in flight ends within the store's timeout
        await asyncio.wait([self._reader], timeout=READER_STOP_S)
        await self.channels.close()

    def _register(self, server) -> None:
        api_pb2_grpc.add_BatonServicer_to_server(self.servicer, server)

    def _describe(self) -> WorkerInfo:
        return WorkerInfo(worker_id=f"gateway-{socket.gethostname()}-{self.port}", role="gateway",
                          address=self.address, model_id=self.model.model_id,
                          model_revision=self.model.info.revision, version=release_version(),
                          incarnation=self.incarnation)

    def stop(self, grace_s: float | None = None) -> None:
        """Drain: NOT_SERVING and UNAVAILABLE for new calls, in-flight streams get ``grace_s``."""
        self.generations.draining = True
        self.grpc.call(self._begin_drain(), timeout_s=READER_STOP_S)
        self.heartbeat.stop()
        self.grpc.stop(grace_s, cleanup=self._after_stop,
                       alongside=self.http.stop if self.http is not None else None)
        if self._stop_metrics is not None:
            self._stop_metrics()
        self.store.close()


def create_server(config: GatewayServiceConfig, store: RoutingStore | None = None
                  ) -> tuple[GatewayServer, int]:
    """A started gateway (``store`` overrides the configured one: tests pass an in-memory
    store) and the port it bound."""
    server = GatewayServer(config, store)
    return server, server.port


def serve(config: GatewayServiceConfig) -> int:
    configure_logging(config.log)
    Mtls(config.mtls).check_service("gateway")
    tracing.configure(config.otlp, "baton-gateway")
    server, _ = create_server(config)
    log.info("gateway for model %s on %s (gRPC)%s", server.model.info.id, server.address,
             f" and http://{config.http.host}:{server.http_port}/v1" if server.http else "")
    try:
        run_until_signalled(server.stop)
    finally:
        tracing.shutdown()
    return 0
