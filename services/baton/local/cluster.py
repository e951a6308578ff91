"""The whole service on one machine as separate processes: ``baton up``, the end-to-end
tests and the serving benchmark all start it from here.

What runs: a routing store every process can reach, ``decode_workers`` decode pods, one
KV-Runahead chain of ``chain_ranks`` prefill ranks (0 = none), and the gateway, each a
``baton <role>`` child process with its flags derived from the configuration tree. Every
server binds port 0 and registers its address in the routing store; the cluster is up when
the store lists all of them (and every child is still alive).

The store: the in-memory store lives inside one process, so it cannot be shared by
separate processes. Without ``redis_url`` the cluster starts its own ``redis-server`` on a
free localhost port (no persistence; ``make setup`` installs the binary) and stops it with
the rest; with ``redis_url`` it uses that Redis. The in-memory store remains the default of
the single-process tools (``baton generate``).

Internal calls are mTLS like a deployed service's (``baton.security.mtls``): the cluster makes a
private CA at start and a certificate per role under ``log_dir/pki`` (``spec.mtls``; off,
every child gets ``--mtls-insecure``). ``mtls_for(role)`` hands a test or a benchmark the
certificate of a role to call the pods' internal ports with.

Children die with the cluster: ``stop()`` (also on any start-up failure and on exit from
the ``with`` block) sends SIGTERM, waits ``STOP_TIMEOUT_S``, then SIGKILL; and on Linux each
child asks the kernel for SIGTERM when its parent dies, so even a killed ``baton up``
leaves nothing behind. Child output goes to one log file per process in ``log_dir``.

Nothing here ticks: waits are on the children's exits (``baton.local.child_exits``), a
stop event and deadlines. ``wait_for_change()`` blocks until ``supervise()`` has work,
and ``baton up`` loops the two. Only readiness is asked again and again, because nothing
announces it: redis-server's PONG and the routing store's records (``READY_RETRY_*_S``).

Once up, ``supervise()`` restarts what died, as Kubernetes restarts a pod: a decode pod or
the gateway alone (the gateway on the address it had), the whole chain when one of its
ranks died (a chain's ranks start together: they meet at a fresh rendezvous port), the
private redis-server on its own port. Each restart waits twice as long as the one before
(``baton.local.processes.RestartBackoff``); a unit that stayed up a minute starts over.

Autoscaled (``spec.autoscale``, driven by ``baton.local.autoscaler``): every pod
serves ``/metrics`` on a free port (``metrics_targets()`` names them for the planner), the
gateway's ``/metrics`` adds the planner's file (``planner_textfile``), and decode pods come
and go: ``add_decode_worker()``, and ``retire_decode_worker(name)``, which sends SIGTERM as
Kubernetes does to a pod it scales away (the pod leaves routing, gives its streams
``decode_grace_s``, exits; the gateway moves a stream still running to another pod) and is
never restarted; ``supervise()`` reaps it, or kills it ``STOP_TIMEOUT_S`` past its grace.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

from baton.config import MtlsConfig
from baton.local.child_exits import StopEvent, wait_for_exits
from baton.local.processes import (
    STOP_TIMEOUT_S,
    Child,
    ManagedRedis,
    RestartBackoff,
    popen_dying_with_parent,
    ready_retries_s,
    terminate,
)
from baton.local.spec import ClusterSpec
from baton.planner.scraper import Target
from baton.serving import free_port

log = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0  # loading models on a busy 2-core machine takes a while
MTLS_DAYS = 2.0  # the local CA's certificates outlive any `baton up`; made anew at every start
START_PORT_RETRIES = 3  # starts of a child that lost a port picked for it to another process


class LocalCluster:
    def __init__(self, spec: ClusterSpec, log_dir: Path | None = None) -> None:
        self.spec = spec
        self._own_dir = log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix="baton-up-")) if log_dir is None else log_dir
        self.redis: ManagedRedis | None = None
        self.redis_url = spec.redis_url
        self.children: list[Child] = []
        self.retiring: list[tuple[Child, float]] = []  # decode pods sent SIGTERM, kill deadline
        self._num_decode_started = 0  # decode pods are named in start order, never reused
        self.gateway_address = ""
        self._restarts = RestartBackoff()
        self._pki: dict[str, MtlsConfig] = {}  # role -> its certificate (spec.mtls)
        if spec.mtls:
            from baton.security.certificates import Authority

            authority = Authority.create(f"baton up {os.getpid()}", days=MTLS_DAYS)
            self._pki = {role: authority.write(self.log_dir / "pki", role, days=MTLS_DAYS)
                         for role in ("gateway", "prefill", "decode")}

    def mtls_for(self, role: str) -> MtlsConfig:
        """A ``role`` certificate of this cluster's CA (for a caller of the pods' internal
        ports: tests, benchmarks); plaintext settings when the cluster runs without mTLS."""
        return self._pki.get(role, MtlsConfig(insecure=True))

    @property
    def gateway_http_url(self) -> str:
        """Base URL of the gateway's OpenAI API (``.../v1``); empty when it is off."""
        port = self.spec.gateway_http_port
        return f"http://127.0.0.1:{port}/v1" if port else ""

    # --- lifecycle -----------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Self:
        try:
            self._start_store(timeout_s)
            for _ in range(self.spec.decode_workers):
                self.add_decode_worker()
            for rank in range(self.spec.chain_ranks):
                self._spawn(f"prefill-{rank}", "prefill", self._chain_args(rank))
            textfile = ["--http-metrics-textfile", str(self.planner_textfile)] if self.spec.autoscale else []
            self._spawn("gateway", "gateway", [
                "--server-listen", self.spec.gateway_listen,
                "--http-port", str(self.spec.gateway_http_port), *self._routing_args(),
                *textfile])
            self.wait_until_registered(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_store(self, timeout_s: float) -> None:
        if self.redis_url:
            return
        self.redis = ManagedRedis(self.log_dir)
        self.redis.wait_ready(timeout_s)
        self.redis_url = self.redis.url

    def _routing_args(self) -> list[str]:
        """How the gateway routes, and a decode pod's own door as well (one rule)."""
        return ["--gateway-prefill-threshold-tokens", str(self.spec.prefill_threshold_tokens),
                "--gateway-chain-break-even", str(self.spec.chain_break_even).lower()]

    def _chain_args(self, rank: int) -> list[str]:
        from baton.runahead.worker import local_backend  # torch: only when there is a chain

        if rank == 0:
            self._master_port = free_port()
        return ["--chain-ranks", str(self.spec.chain_ranks), "--chain-rank", str(rank),
                "--chain-chain-id", "chain-0", "--chain-master-port", str(self._master_port),
                "--chain-backend", local_backend("auto", self.spec.chain_ranks)]

    def _spawn(self, name: str, role: str, args: list[str]) -> Child:
        metrics_port = free_port() if self.spec.autoscale else 0
        metrics = ["--server-metrics-port", str(metrics_port)] if metrics_port else []
        command = [sys.executable, "-m", "baton.cli", role, *self._common_args(role), *metrics,
                   *args, *self.spec.extra_args.get(role, [])]
        log_path = self.log_dir / f"{name}.log"
        log_start = log_path.stat().st_size if log_path.exists() else 0
        threads = str(self.spec.threads_of(role))
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "PYTHONUNBUFFERED": "1"}
        with log_path.open("ab") as log_file:  # a restart appends: the crash stays readable
            process = popen_dying_with_parent(command, stdout=log_file, stderr=subprocess.STDOUT,
                                               env=env)
        child = Child(name, role, process, log_path, args, metrics_port, log_start)
        if role == "decode" and "--http-port" in args:  # its door (kept on a restart)
            child.http_port = int(args[args.index("--http-port") + 1])
        self.children.append(child)
        return child

    def _common_args(self, role: str) -> list[str]:
        args = ["--routing-redis-url", self.redis_url,
                "--routing-heartbeat-s", str(self.spec.heartbeat_s),
                "--routing-worker-ttl-s", str(self.spec.worker_ttl_s),
                "--routing-view-refresh-s", str(min(0.2, self.spec.heartbeat_s))]
        if role != "gateway":
            args += ["--server-listen", "127.0.0.1:0",
                     "--model-threads", str(self.spec.threads_of(role)),
                     "--kv-transport-kind", self.spec.kv_transport,
                     "--kv-cache-dtype", self.spec.kv_cache.dtype,
                     "--kv-cache-scale", repr(self.spec.kv_cache.scale)]
        if role == "prefill" and self.spec.prefill_tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.spec.prefill_tensor_parallel_size)]
        if role == "decode":
            args += ["--stream-interval-ms", str(self.spec.stream_interval_ms),
                     "--server-grace-s", str(self.spec.decode_grace_s)]
            if self.spec.decode_tensor_parallel_size > 1:
                args += ["--tensor-parallel-size", str(self.spec.decode_tensor_parallel_size)]
        if self.spec.model_path:
            args += ["--model-path", self.spec.model_path]
        if self.spec.model_revision:
            args += ["--model-revision", self.spec.model_revision]
        if self.spec.max_model_len:
            args += ["--model-max-model-len", str(self.spec.max_model_len)]
        if self.spec.served_model_names:
            args += ["--model-served-model-name", ",".join(self.spec.served_model_names)]
        mtls = self.mtls_for(role)
        args += (["--mtls-ca", mtls.ca, "--mtls-cert", mtls.cert, "--mtls-key", mtls.key]
                 if mtls.cert else ["--mtls-insecure", "true"])
        log, otlp = self.spec.log, self.spec.otlp
        args += ["--log-level", log.level, "--log-format", log.format,
                 "--log-requests", str(log.requests).lower()]
        if otlp.traces_endpoint:
            args += ["--otlp-traces-endpoint", otlp.traces_endpoint]
        return args

    def wait_until_registered(self, timeout_s: float) -> None:
        """Until the store lists the gateway, every decode pod and every chain rank that
        registers; raises naming a child that exited (with its log) or the timeout."""
        from baton.routing.redis_store import RedisStore

        store = RedisStore(self.redis_url)
        roles: list[str] = []
        try:
            for wait_s in ready_retries_s(time.monotonic() + timeout_s):
                self._start_again_after_lost_ports()
                self.check_alive()
                workers = store.list_workers()
                roles = [worker.role for worker in workers]
                gateways = [worker for worker in workers if worker.role == "gateway"]
                if (gateways and roles.count("decode") >= self.spec.decode_workers
                        and (self.spec.chain_ranks == 0 or "prefill" in roles)):
                    self.gateway_address = gateways[0].address
                    return
                # a child's death ends the wait at once: check_alive then names it
                wait_for_exits([child.process for child in self.children], wait_s)
            raise TimeoutError(f"the cluster did not register in {timeout_s:g} s; "
                               f"registered: {sorted(roles)}; logs in {self.log_dir}")
        finally:
            store.close()

    def _start_again_after_lost_ports(self) -> None:
        """A child that died at start binding a port it was given (``free_port`` picks it
        free; another process on the machine may bind it first) starts again, with ports
        picked anew (``START_PORT_RETRIES`` times at most; a port fixed by the spec stays)."""
        for child in list(self.children):
            if (child.process.poll() is not None and child.port_retries < START_PORT_RETRIES
                    and child.lost_a_port()):
                log.warning("%s lost a port to another process as it started: starting it "
                            "again", child.name)
                self.children.remove(child)
                again = self._spawn(child.name, child.role, child.args)
                again.port_retries = child.port_retries + 1

    def check_alive(self) -> None:
        for child in self.children:
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {child.process.returncode}:\n"
                                   f"{child.log_tail()}")

    # --- supervision ----------------------------------------------------------------------

    def wait_for_change(self, timeout_s: float, stop: StopEvent | None = None) -> None:
        """Block until ``supervise()`` has something to do: a child (or the private
        redis-server) exits, a dead unit's restart back-off ends, a retiring pod exits or
        outstays its grace; or until ``stop`` is set or ``timeout_s`` has passed."""
        now = time.monotonic()
        deadline = now + timeout_s
        running = []
        for unit, processes in self._units():
            alive = [process for process in processes if process.poll() is None]
            if len(alive) < len(processes):  # dead: due again when its back-off ends
                deadline = min(deadline, self._restarts.due_at(unit))
            running += alive
        for child, kill_at in self.retiring:
            running.append(child.process)
            deadline = min(deadline, kill_at)
        wait_for_exits(running, deadline - now, stop)

    def supervise(self) -> list[str]:
        """Restart whatever died and is due (see the module's docstring); one line per
        restart, naming the exit code and the attempt."""
        now = time.monotonic()
        events = self._reap_retired(now)
        for unit, processes in self._units():
            if any(process.poll() is not None for process in processes) and self._restarts.take(unit, now):
                events.append(self._restart(unit))
        return events

    def _units(self) -> list[tuple[str, list[subprocess.Popen]]]:
        """What restarts as one, with its processes: the private redis-server, the chain
        (its ranks meet at one rendezvous: all start again), each other child alone."""
        units = [("redis", [self.redis.process])] if self.redis is not None else []
        chain = [child.process for child in self.children if child.role == "prefill"]
        if chain:
            units.append(("chain", chain))
        return units + [(child.name, [child.process]) for child in self.children
                        if child.role != "prefill"]

    def _restart(self, unit: str) -> str:
        """Start a dead unit again; the line that says so."""
        if unit == "redis":
            code = self.redis.process.returncode
            self.redis.start()
            return self._restarted("redis-server", code, f"on port {self.redis.port}")
        if unit == "chain":
            chain = [child for child in self.children if child.role == "prefill"]
            dead_ranks = [child for child in chain if child.process.poll() is not None]
            for child in chain:
                terminate(child.process)
                self.children.remove(child)
            for rank in range(self.spec.chain_ranks):
                self._spawn(f"prefill-{rank}", "prefill", self._chain_args(rank))
            names = ", ".join(f"{child.name} ({child.process.returncode})" for child in dead_ranks)
            return self._restarted("the chain", None, f"(lost {names})")
        child = self.child(unit)
        args = child.args
        if child.role == "gateway" and self.gateway_address:  # keep its address
            args = ["--server-listen", self.gateway_address,
                    *args[args.index("--server-listen") + 2:]]
        self.children.remove(child)
        self._spawn(child.name, child.role, args)
        return self._restarted(child.name, child.process.returncode, f"(log {child.log_path})")

    def _restarted(self, what: str, code: int | None, detail: str) -> str:
        unit = {"redis-server": "redis", "the chain": "chain"}.get(what, what)
        exit_code = "" if code is None else f" exited with {code};"
        return f"{what}{exit_code} restarted {detail}, restart {self._restarts.count(unit)}"

    def stop(self) -> None:
        """Stop every child (gateway first, so no request lands on a dying worker), then Redis."""
        everyone = [*self.children, *(child for child, _ in self.retiring)]
        for child in reversed(everyone):
            if child.process.poll() is None:
                child.process.terminate()
        for child in reversed(everyone):
            terminate(child.process)
        if self.redis is not None:
            self.redis.stop()
        if self._own_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- for tests and the demo ---------------------------------------------------------

    def child(self, name: str) -> Child:
        return next(child for child in self.children if child.name == name)

    def add_decode_worker(self) -> Child:
        """Start one more decode pod; it joins routing by itself once it registers."""
        self._num_decode_started += 1
        door = ["--http-port", str(free_port()), *self._routing_args()] if self.spec.decode_http else []
        return self._spawn(f"decode-{self._num_decode_started - 1}", "decode", door)

    def decode_http_url(self, child: Child) -> str:
        """Base URL of a decode pod's own OpenAI door (``.../v1``; spec.decode_http)."""
        return f"http://127.0.0.1:{child.http_port}/v1"

    # --- autoscaling ----------------------------------------------------------------------

    @property
    def planner_textfile(self) -> Path:
        """Where the planner's metrics go for the gateway's ``/metrics`` (autoscaled only)."""
        return self.log_dir / "planner.prom"

    @property
    def num_chains(self) -> int:
        return 1 if self.spec.chain_ranks else 0

    def decode_pods(self) -> list[Child]:
        """The decode pods serving or starting (not those retiring)."""
        return [child for child in self.children if child.role == "decode"]

    def metrics_targets(self) -> list[Target]:
        """Every pod's ``/metrics`` but the retiring ones', for the planner's scrape."""
        return [Target(child.name, child.role, f"http://127.0.0.1:{child.metrics_port}/metrics",
                       chain="chain-0" if child.role == "prefill" else "")
                for child in self.children if child.metrics_port]

    def retire_decode_worker(self, name: str) -> Child:
        """Take decode pod ``name`` out of the cluster loss-free: SIGTERM makes it leave
        routing, finish its streams within ``decode_grace_s`` and exit (the gateway moves a
        stream it did not finish); it is not restarted, and killed if it outstays its grace."""
        child = next(c for c in self.decode_pods() if c.name == name)
        self.children.remove(child)
        child.process.terminate()
        self.retiring.append((child, time.monotonic() + self.spec.decode_grace_s + STOP_TIMEOUT_S))
        return child

    def _reap_retired(self, now: float) -> list[str]:
        """Forget the retired decode pods that exited; kill those past their deadline."""
        events, still = [], []
        for child, deadline in self.retiring:
            if child.process.poll() is not None:
                events.append(f"{child.name} drained and exited ({child.process.returncode})")
            elif now > deadline:
                child.process.kill()
                child.process.wait()
                events.append(f"{child.name} did not exit within "
                              f"{self.spec.decode_grace_s + STOP_TIMEOUT_S:g} s of SIGTERM: killed")
            else:
                still.append((child, deadline))
        self.retiring = still
        return events
