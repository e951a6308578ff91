"""The decode pod's engine loop and the table of the requests it serves.

Design: one loop thread owns the SARATHI ``Engine`` and calls ``step()`` (the engine is not
reentrant); the gRPC handlers (coroutines on the server's event loop) only use the engine's
thread-safe entry points (``add_request``, ``add_prefilled_request``, ``abort``) and read the
``RequestStream`` of their request. The loop reads as verbs: wait for work -> step ->
publish every output to its stream and tell the server once (``on_published``) -> expire
the leases of pushed requests nobody attached to (``baton.decode.leases``) -> publish the
load (``baton.decode.load``).

Requests enter two ways: a prompt prefilled here (``submit_prompt``), or a cache a chain
pushes (``baton.decode.pushed``, the worker's part for pushes). A failing step fails the
streams it touched, never the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable

from baton.api.requests import DecodeRequest, Route
from baton.config import KVPoolConfig, ServerConfig
from baton.decode.errors import RequestExists, RequestLeaving
from baton.decode.leases import AttachLeases, Recent
from baton.decode.load import LoadReport
from baton.decode.pushed import PushedRequests
from baton.decode.streams import EngineStalled, RequestStream, StreamFailed
from baton.errors import ResourceExhausted
from baton.kv.pool import KVPoolExhausted
from baton.metrics import DecodeMetrics
from baton.parallel.leader import GroupDown
from baton.routing.store import WorkerLoad
from baton.sampling.limits import check_prompt
from baton.sampling.params import FINISH_ABORT
from baton.sarathi.engine import Engine
from baton.sarathi.request import RequestOutput

log = logging.getLogger(__name__)

# A plan with nothing to run (every sequence waits for KV) waits for a request or an abort,
# and at most this long: a step then plans again, as a guard should anything else free KV.
BLOCKED_WAIT_S = 0.01


class DecodeWorker(PushedRequests):
    def __init__(self, engine: Engine, address: str, metrics: DecodeMetrics,
                 lease_s: float = KVPoolConfig.unclaimed_lease_s,
                 max_queued_requests: int = ServerConfig.max_queued_requests,
                 on_group_down: Callable[[], None] = lambda: None) -> None:
        """``on_group_down``: called (on the loop thread, which then ends) when the engine's
        tensor-parallel group broke: the pod must go."""
        self.engine = engine
        self.on_group_down = on_group_down
        self.lease_s = lease_s
        self.max_queued_requests = max_queued_requests
        self.address = address
        self.metrics = metrics
        self.model_config = engine.model.config
        self._streams: dict[str, RequestStream] = {}
        self._aborted_early: Recent[None] = Recent()  # so that a late push is refused
        # Pushes refused or lost before their stream opened: why, for the Attach that waits.
        self._failed_pushes: Recent[str] = Recent()
        self._leases = AttachLeases(lease_s)  # pushed requests nobody attached to yet
        self._lock = threading.Lock()  # guards the four above
        self._queued_prompt_tokens = 0  # local prompts accepted, not yet at their first token
        self._queued_requests = 0  # and how many they are
        self.report = LoadReport(engine, metrics)
        self._stopping = threading.Event()
        self._step_started_s: float | None = None  # while the loop is inside engine.step()
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        # Set by the server: called (from the loop thread) once per step with the streams that
        # got steps, and (from any thread) whenever a request arrives, ends or is aborted.
        self.on_published: Callable[[Iterable[RequestStream]], None] = lambda streams: None
        self.on_change: Callable[[], None] = lambda: None

    @property
    def load(self) -> WorkerLoad:
        """The load as of the last step (``LoadReport``); any thread."""
        return self.report.load

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self.engine.wake()  # an idle loop waits on the engine's work event
        self._thread.join()

    # --- requests (handler threads) ------------------------------------------------------

    def submit_prompt(self, request: DecodeRequest) -> RequestStream:
        """Queue a prompt for a local prefill; its stream is attached to the caller."""
        check_prompt(request.prompt_token_ids, request.sampling, self.model_config.vocab_size,
                     self.model_config.max_position_embeddings)
        capacity = self.engine.memory.capacity_tokens()
        num_prompt_tokens = len(request.prompt_token_ids)
        stream = RequestStream(request.request_id, num_prompt_tokens, Route(self.address),
                               attached=True, queued=True, traceparent=request.traceparent)
        with self._lock:
            if self._queued_requests >= self.max_queued_requests:
                raise ResourceExhausted(f"{self._queued_requests} requests wait for a prefill on "
                                        f"this pod, at most {self.max_queued_requests}; retry later")
            self._claim(stream)
            # A bounded queue: at most one pool's worth of prompt tokens waits for a prefill.
            if self._queued_prompt_tokens + num_prompt_tokens > capacity and self._queued_prompt_tokens:
                del self._streams[stream.request_id]
                raise KVPoolExhausted(self.engine.pool.blocks_for(num_prompt_tokens),
                                      self.engine.pool.num_free_blocks)
            self._queued_prompt_tokens += num_prompt_tokens
            self._queued_requests += 1
        # The request's compression overrides ride with its sampling params into the engine.
        params = dataclasses.replace(request.sampling, compression=request.compression)
        self._enter(stream, lambda: self.engine.add_request(
            list(request.prompt_token_ids), params, request.request_id, request.generated_before,
            request.cache_salt),
            queued_tokens=num_prompt_tokens)
        return stream

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV; True when this pod held (or awaited) it."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and stream.in_engine:
                stream.leaving = True
                self.engine.abort(request_id)  # its stream ends with finish reason "aborted"
                return True
            self._aborted_early.add(request_id, None)  # a push or attach may still be on its way
        if stream is not None:  # announced, its KV still arriving: the push is refused
            self._end_announced(stream)
        self.on_change()
        return stream is not None

    def cancel(self, request_id: str) -> None:
        """The caller went away: abort quietly (nothing to tell)."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and stream.in_engine:
                stream.leaving = True
        if stream is None:
            return
        if stream.in_engine:
            self.engine.abort(request_id)
        else:  # the rest of its push is refused: submit_pushed finds its stream gone
            self._end_announced(stream)

    def _end_announced(self, stream: RequestStream) -> None:
        """End a pushed stream whose KV has not reached the engine: its last step says
        aborted, and the rest of its push is refused (``submit_pushed`` finds it gone)."""
        with self._lock:
            if self._streams.get(stream.request_id) is not stream:
                return
            del self._streams[stream.request_id]
            self._leases.awaiting.pop(stream.request_id, None)
        now_s = time.monotonic()
        stream.publish(RequestOutput(stream.request_id, [], "", finish_reason=FINISH_ABORT), now_s)
        self.on_published([stream])

    def _claim(self, stream: RequestStream) -> None:
        existing = self._streams.get(stream.request_id)
        if existing is not None and existing.leaving:
            raise RequestLeaving(f"request id {stream.request_id!r} is still leaving this pod "
                                 f"(aborted)")
        if existing is not None:
            raise RequestExists(f"request id {stream.request_id!r} is already live on this pod")
        self._streams[stream.request_id] = stream
        self.on_change()  # the caller holds _lock: on_change only schedules, it never waits

    def _enter(self, stream: RequestStream, add, queued_tokens: int = 0) -> None:
        """Hand the request to the engine; on refusal, forget the stream again."""
        try:
            add()
        except Exception:
            with self._lock:
                self._streams.pop(stream.request_id, None)
                self._queued_prompt_tokens -= queued_tokens
                self._queued_requests -= 1 if queued_tokens else 0
            raise

    # --- the loop thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            if not self.engine.has_work():
                self.engine.wait_for_work()  # a request, an abort, a landing or stop() wakes it
                continue
            started_s = self._step_started_s = time.monotonic()
            try:
                outputs = self.engine.step()
            except GroupDown as e:  # no step can run any more: the pod goes, its streams move
                log.error("decode engine lost its tensor-parallel group: %s", e)
                self.on_group_down()
                return
            except Exception as e:
                log.exception("engine step failed")
                self._fail_all(f"the decode engine failed: {e!r}")
                continue
            finally:
                step_s = time.monotonic() - started_s
                self._step_started_s = None
            self.report.measure_prefill(step_s)
            self._record_scheduled(started_s)
            self._publish(outputs)
            self._expire_leases()
            self.report.publish()
            if not outputs and self.engine.last_plan is not None and self.engine.last_plan.is_empty:
                self.engine.wait_for_work(BLOCKED_WAIT_S)

    def _publish(self, outputs) -> None:
        now_s = time.monotonic()
        touched = []
        for output in outputs:
            with self._lock:
                stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            touched.append(stream)
            first = stream.first_token_s is None and bool(output.new_token_ids)
            num_tokens_before = stream.num_tokens
            gaps_s = stream.publish(output, now_s)
            self._record_output(stream, output, first, stream.num_tokens - num_tokens_before,
                                gaps_s, now_s)
            if (first or output.finished) and stream.pushed is None:
                self._settle_queued(stream)
            if output.finished:
                if stream.traceparent:
                    stream.record_trace(now_s)
                with self._lock:
                    self._streams.pop(output.request_id, None)
                    if stream.pushed is not None and not stream.attached:
                        dropped = self._leases.keep_unclaimed(stream, now_s)
                        self.metrics.kv_leases_expired.inc(dropped)
                self.on_change()
        if touched:
            self.on_published(touched)

    def _record_output(self, stream: RequestStream, output: RequestOutput, first: bool,
                       num_new_tokens: int, gaps_s: list[float], now_s: float) -> None:
        """One output's part in the metrics. The request-level latencies are observed for a
        prompt prefilled here only: a pushed request arrived at the gateway, which observes them."""
        vllm = self.metrics.vllm
        vllm.generation_tokens.inc(num_new_tokens)
        for gap_s in gaps_s:  # one per token after the first (the engine yields one a step)
            self.metrics.time_between_tokens_s.observe(gap_s)
            vllm.inter_token_latency_s.observe(gap_s)
        local = stream.pushed is None
        if first and local:
            self.metrics.ttft_s.observe(now_s - stream.arrival_s)
            vllm.latencies.ttft_s.observe(now_s - stream.arrival_s)
            vllm.prompt_tokens.inc(stream.num_prompt_tokens)
        if output.finished:
            self.metrics.requests_finished.labels(reason=output.finish_reason).inc()
            vllm.record_finished(output.finish_reason)
            if local:
                vllm.latencies.e2e_s.observe(now_s - stream.arrival_s)

    def _record_scheduled(self, step_started_s: float) -> None:
        """The queue time of the local prompts whose first prefill chunk the last step ran."""
        plan = self.engine.last_plan
        if plan is None:
            return
        for chunk in plan.prefills:
            with self._lock:
                stream = self._streams.get(chunk.seq.request_id)
            if stream is not None and stream.pushed is None and not stream.scheduled:
                stream.scheduled = True
                self.metrics.vllm.request_queue_time_s.observe(step_started_s - stream.arrival_s)

    def _expire_leases(self) -> None:
        """Abort the pushed requests nobody attached to within ``lease_s`` (oldest first)."""
        with self._lock:
            expired = self._leases.expired(time.monotonic())
        for stream in expired:
            log.warning("request %s: no Attach within %g s of its KV; freeing it",
                        stream.request_id, self.lease_s)
            self.metrics.kv_leases_expired.inc()
            if stream.in_engine:
                self.engine.abort(stream.request_id)
            else:
                self.cancel(stream.request_id)

    def _settle_queued(self, stream: RequestStream) -> None:
        """A local prompt leaves the queue once (at its first token, or when it ends first)."""
        if not stream.queued:
            return
        stream.queued = False
        with self._lock:
            self._queued_prompt_tokens -= stream.num_prompt_tokens
            self._queued_requests -= 1

    def step_running_s(self) -> float:
        """How long the engine's current step has run (0 between steps); any thread."""
        started = self._step_started_s
        return 0.0 if started is None else time.monotonic() - started

    def fail_stalled(self, message: str) -> None:
        """Fail every stream with ``EngineStalled``, from another thread while the loop is stuck
        in a step: the engine is not touched (its thread may hold what it would need)."""
        self._fail_streams(message, EngineStalled)

    def _fail_all(self, message: str) -> None:
        for stream in self._fail_streams(message, StreamFailed):
            self.engine.abort(stream.request_id)

    def _fail_streams(self, message: str, error: type[StreamFailed]) -> list[RequestStream]:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self._leases.awaiting.clear()
            self._queued_prompt_tokens = 0
            self._queued_requests = 0
        for stream in streams:
            stream.fail(message, error)
            self.metrics.vllm.record_finished("error")
        self.on_published(streams)
        self.on_change()
        return streams
