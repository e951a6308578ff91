"""What every baton gRPC server shares: binding (plaintext, TLS, or an internal port's mTLS
credentials from ``baton.security.mtls``), the standard health
service, the advertised address, the release version and a graceful stop on SIGTERM/SIGINT.

Every server is an ``AsyncGrpcServer``: ``grpc.aio`` on an event loop of its own thread, so
a stream that waits costs a coroutine, not a thread; at most ``server.max_streams`` calls at
once, RESOURCE_EXHAUSTED beyond. It starts in the constructor and stops with
``stop(grace_s)``.

A server starts NOT_SERVING (its model is still loading) and turns SERVING once it can take
requests; during a graceful stop it is NOT_SERVING again, so load balancers and the gateway
stop sending work while in-flight calls get ``grace_s`` to finish.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import signal
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.config import ServerConfig
from baton.security.mtls import reloading_server_credentials

log = logging.getLogger(__name__)

# A pushed KV chunk is ~1 MiB (baton.transfer.codec.CHUNK_BYTES); leave room for the framing and for
# callers that send larger chunks, far below anything that could exhaust memory.
MAX_MESSAGE_BYTES = 16 << 20
# Ports are bound exclusively: with gRPC's default SO_REUSEPORT a second server (a second
# `baton up`) binds the same address silently and takes a share of the connections.
GRPC_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                # Servers accept the pings of the channels below (no "too_many_pings" GOAWAY, which
                # makes a channel double its ping interval after each one).
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
                ("grpc.http2.max_ping_strikes", 0),
                ("grpc.keepalive_permit_without_calls", 1)]
# Channels between pods ping their peer: a pod that is alive to TCP but not answering (stopped,
# wedged, a half-open connection) fails its calls with UNAVAILABLE within ~KEEPALIVE_S * 2
# instead of holding them forever, so the gateway can move them elsewhere.
KEEPALIVE_S = 2
KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
                     ("grpc.keepalive_timeout_ms", KEEPALIVE_S * 1000),
                     ("grpc.http2.ping_timeout_ms", KEEPALIVE_S * 1000),  # else 60 s, whatever the above
                     ("grpc.http2.max_pings_without_data", 0)]
CHANNEL_OPTIONS = [*GRPC_OPTIONS, *KEEPALIVE_OPTIONS]
# Servers whose callers are other pods ping them the same way (``ping_callers``): a caller
# that vanished without closing its connection (its node lost, its process stopped) has its
# calls cancelled within ~KEEPALIVE_S * 2, and what they held is freed (a gateway's session
# on a decode pod carries every request it streams there).


def new_incarnation() -> str:
    """An id for this process's life: routing records carry it, and work meant for another
    process that had the same address is refused (``baton.errors.WrongIncarnation``)."""
    return uuid.uuid4().hex[:16]


def release_version() -> str:
    """The installed baton release (``dev`` when run from a source tree without metadata)."""
    try:
        return importlib.metadata.version("baton")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


class _Binding:
    """Binding and the advertised address, the same for both kinds of server."""

    config: ServerConfig
    credentials: grpc.ServerCredentials | None = None  # an internal port's mTLS (baton.security.mtls)

    def _bind(self, server) -> int:
        try:
            if self.credentials is not None:
                port = server.add_secure_port(self.config.listen, self.credentials)
            elif not self.config.tls_cert:
                port = server.add_insecure_port(self.config.listen)
            else:
                credentials = reloading_server_credentials(self.config.tls_key, self.config.tls_cert)
                port = server.add_secure_port(self.config.listen, credentials)
        except RuntimeError as e:  # grpc's "Failed to bind": the address is taken or not ours
            port = 0
            cause = e
        else:
            cause = None
        if port == 0:
            raise ValueError(f"cannot bind the gRPC server to {self.config.listen!r}: the address "
                             f"is in use (another baton?) or not available here") from cause
        return port

    def _advertised_address(self, port: int) -> str:
        if self.config.advertise:
            return self.config.advertise
        host = listen_host(self.config.listen)
        if host in ("", "0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"{host}:{port}"


def listen_host(listen: str) -> str:
    """The host of a ``host:port`` listen address (an IPv6 one keeps its brackets)."""
    return listen.rpartition(":")[0]


def _serving_status(serving: bool):
    return (health_pb2.HealthCheckResponse.SERVING if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING)


class AsyncGrpcServer(_Binding):
    """A started ``grpc.aio`` server on an event loop in its own thread ("grpc-aio").

    ``register(server)`` adds servicers whose handlers are coroutines; they run on ``loop``,
    so they must not block it (hand blocking work to ``loop.run_in_executor``). Other threads
    reach the loop through ``loop.call_soon_threadsafe`` (as the decode engine's thread does
    once per step) or ``call``."""

    def __init__(self, config: ServerConfig, register: Callable[[grpc.aio.Server], None],
                 service_names: list[str], credentials: grpc.ServerCredentials | None = None,
                 ping_callers: bool = False) -> None:
        """``ping_callers``: keepalive pings to callers (``KEEPALIVE_OPTIONS``), for a server
        whose callers are pods, not clients on networks of their own."""
        self.config = config
        self.ping_callers = ping_callers
        self.service_names = service_names
        self.credentials = credentials
        self.serving = False  # what the health service says
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self._thread.start()
        try:
            self.port = self.call(self._start(register))
        except BaseException:
            self._stop_loop()
            raise
        self.address = self._advertised_address(self.port)
        log.info("gRPC server on %s (advertised as %s, at most %d calls at once)", config.listen,
                 self.address, config.max_streams)

    def call(self, coroutine, timeout_s: float | None = None):
        """Run a coroutine on the server's loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    async def _start(self, register) -> int:
        # gRPC's core cancels calls that arrive faster than the server takes them beyond
        # max_pending_requests (1000 by default): a burst of 2,000 streams lost ~200 of them
        # as CANCELLED. Up to max_streams may wait; beyond, RESOURCE_EXHAUSTED says so.
        limits = [("grpc.server.max_pending_requests", self.config.max_streams),
                  ("grpc.server.max_pending_requests_hard_limit", self.config.max_streams),
                  ("grpc.max_receive_message_length", self.config.max_message_mib << 20)]
        own = limits + (KEEPALIVE_OPTIONS if self.ping_callers else [])
        options = [option for option in GRPC_OPTIONS if option[0] not in dict(own)] + own
        self.server = grpc.aio.server(options=options,
                                      maximum_concurrent_rpcs=self.config.max_streams)
        register(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self.set_serving_async(False)
        port = self._bind(self.server)
        await self.server.start()
        return port

    async def set_serving_async(self, serving: bool) -> None:
        """``set_serving`` from a coroutine on the server's loop."""
        self.serving = serving
        for name in ["", *self.service_names]:
            await self.health.set(name, _serving_status(serving))

    def set_serving(self, serving: bool) -> None:
        self.call(self.set_serving_async(serving))

    def stop(self, grace_s: float | None = None,
             cleanup: Callable[[], Awaitable[None]] | None = None,
             alongside: Callable[[float], Awaitable[None]] | None = None) -> None:
        """NOT_SERVING, then stop taking calls; in-flight ones get ``grace_s`` to finish.
        ``alongside(grace_s)`` drains another server on this loop meanwhile (the gateway's
        HTTP API); ``cleanup`` runs on the loop after both stopped (e.g. closing client
        channels that belong to this loop)."""
        grace_s = self.config.grace_s if grace_s is None else grace_s
        try:
            self.call(self._stop(grace_s, cleanup, alongside), timeout_s=grace_s + 10.0)
        finally:
            self._stop_loop()

    async def _stop(self, grace_s: float, cleanup, alongside) -> None:
        await self.set_serving_async(False)
        await asyncio.gather(self.server.stop(grace_s),
                             *([alongside(grace_s)] if alongside is not None else []))
        if cleanup is not None:
            await cleanup()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)


def run_until_signalled(stop: Callable[[], None], stopping: threading.Event | None = None) -> None:
    """Block the main thread until SIGTERM or SIGINT (or ``stopping`` is set by the server
    itself), then call ``stop`` (graceful)."""
    stopping = stopping or threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stopping.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stop()


def free_port() -> int:
    """A loopback port nothing listens on now, for a server started on this machine (the
    caller binds it soon after; another process may take it in between, which a local
    start then reports as its bind error)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
