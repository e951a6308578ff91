"""The decode pod's engine loop and the table of the requests it serves.

Design: one loop thread owns the SARATHI ``Engine`` and calls ``step()`` (the engine is not
reentrant); the gRPC handlers (coroutines on the server's event loop) only use the engine's
thread-safe entry points (``add_request``, ``add_prefilled_request``, ``abort``) and read the
``RequestStream`` of their request. The loop reads as verbs: wait for work -> step ->
publish every output to its stream and tell the server once (``on_published``) -> publish
the load (free blocks, running sequences, queued prompt tokens) that ``Stats``, the
heartbeat and the metrics read. Only the loop thread touches the scheduler, so the load is
a snapshot it takes, never a read of its queues from another thread.

Requests enter two ways: a prompt prefilled here (``submit_prompt``), or a cache a chain
pushes: its header (``announce_push``) opens the stream with the chain's first token, its
checked payload (``submit_pushed``) hands it to the engine, and a push that fails on the
way (``push_failed``) fails the stream, or, refused before it opened one, is remembered for
the Attach that waits for it. A pushed request is claimed by ``try_attach``, usually before
the push begins: the caller waits for ``on_change`` and tries again. A failing step fails
the streams it touched, never the loop.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable

from baton.api import convert
from baton.api.requests import DecodeRequest, Route
from baton.decode.streams import EngineStalled, PushedKVInfo, PushLost, RequestStream, StreamFailed
from baton.dtypes import DTYPES
from baton.errors import Aborted, AlreadyExists, DataLoss, NotFound, ResourceExhausted
from baton.kv.pool import KVPoolExhausted
from baton.metrics import DecodeMetrics
from baton.model.limits import check_prompt
from baton.model.sampling import FINISH_ABORT
from baton.model.tokenizer import IncrementalDecoder
from baton.routing.prefix_index import PrefixPublisher
from baton.routing.store import WorkerLoad
from baton.sarathi.engine import Engine
from baton.sarathi.request import RequestOutput
from baton.transfer.device_copy import to_device
from baton.transfer.handoff import KVHandoff
from baton.transfer.receiver import PushedCache

log = logging.getLogger(__name__)

PREFILL_RATE_WEIGHT = 0.2  # the newest step's share of the advertised prefill rate
# A plan with nothing to run (every sequence waits for KV) waits for a request or an abort,
# and at most this long: a step then plans again, as a guard should anything else free KV.
BLOCKED_WAIT_S = 0.01
DEFAULT_LEASE_S = 30.0  # how long a pushed request waits for its Attach (kv.unclaimed_lease_s)
ABORTED_MEMORY = 1024  # aborted-before-push ids remembered, so a late push is refused


class RequestExists(AlreadyExists):
    """A live request already has this id (gRPC ALREADY_EXISTS)."""


class RequestLeaving(RequestExists):
    """The id's stream was aborted and has not left the engine yet (ALREADY_EXISTS if it
    does not leave in time)."""


class RequestNotFound(NotFound):
    """No state for this request id (gRPC NOT_FOUND)."""


class RequestAborted(Aborted):
    """The request was aborted before its cache arrived (gRPC ABORTED)."""


class PushFailed(DataLoss):
    """The chain's push for this request was refused or lost before its stream opened
    (gRPC DATA_LOSS: the KV will not come; the caller prefills the prompt, here or
    elsewhere)."""


class DecodeWorker:
    def __init__(self, engine: Engine, address: str, metrics: DecodeMetrics,
                 lease_s: float = DEFAULT_LEASE_S, max_queued_requests: int = 1024) -> None:
        self.engine = engine
        self.lease_s = lease_s
        self.max_queued_requests = max_queued_requests
        self.address = address
        self.metrics = metrics
        self.model_config = engine.model.config
        self._streams: dict[str, RequestStream] = {}
        self._aborted_early: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Pushes refused or lost before their stream opened: why, for the Attach that waits.
        self._failed_pushes: collections.OrderedDict[str, str] = collections.OrderedDict()
        # Pushed requests that finished before anyone attached (max_tokens 1, or a stop token
        # first): their steps wait here for the Attach, for lease_s at most.
        self._unclaimed: collections.OrderedDict[str, tuple[RequestStream, float]] = \
            collections.OrderedDict()
        # Pushed requests still running that nobody attached to yet, oldest first: one that
        # waits past lease_s is aborted (its caller is gone), which frees its KV.
        self._awaiting_attach: collections.OrderedDict[str, RequestStream] = collections.OrderedDict()
        self._lock = threading.Lock()  # guards the three above
        self._queued_prompt_tokens = 0  # local prompts accepted, not yet at their first token
        self._queued_requests = 0  # and how many they are
        self._prefix_mark = (0, 0)  # the prefix cache's (lookups, last event) last published
        self._prefill_rate = 0.0  # prompt tokens a second (see _measure_prefill)
        # Set by the pod: where the prefix cache's events go (for cache-aware routing).
        self.prefix_publisher: PrefixPublisher | None = None
        self.load = WorkerLoad(free_kv_blocks=engine.pool.num_free_blocks,
                               total_kv_blocks=engine.pool.num_blocks)
        self._stopping = threading.Event()
        self._step_started_s: float | None = None  # while the loop is inside engine.step()
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        # Set by the server: called (from the loop thread) once per step with the streams that
        # got steps, and (from any thread) whenever a request arrives, ends or is aborted.
        self.on_published: Callable[[Iterable[RequestStream]], None] = lambda streams: None
        self.on_change: Callable[[], None] = lambda: None
        metrics.kv_blocks_total.set(engine.pool.num_blocks)

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
                               attached=True, queued=True)
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

    def announce_push(self, handoff: KVHandoff) -> RequestStream:
        """A checked push header: the request's stream opens, with the chain's first token
        unless that follows (``publish_pushed_first``); the KV follows."""
        full = len(handoff.prompt_token_ids) * len(handoff.kv.layer_num_tokens)
        kept = sum(handoff.kv.layer_num_tokens)
        stream = RequestStream(handoff.request_id, len(handoff.prompt_token_ids),
                               Route(self.address),
                               PushedKVInfo(handoff.kv.total_bytes, kept, full), in_engine=False)
        with self._lock:
            if handoff.request_id in self._aborted_early:
                raise RequestAborted(f"request {handoff.request_id!r} was aborted before its KV "
                                     f"arrived")
            self._claim(stream)
            self._failed_pushes.pop(handoff.request_id, None)  # an earlier push's failure
            self._awaiting_attach[handoff.request_id] = stream
        if not handoff.first_token_follows:
            self.publish_pushed_first(stream, handoff)
        return stream

    def land(self, handoff: KVHandoff) -> concurrent.futures.Future | None:
        """Ask the engine for the pool's blocks of a pushed cache whose header checked out, so
        that its keys and values are copied straight into them as they arrive
        (``baton.transfer.received``); None where the pool cannot take its bytes as they are (a
        device pool, another dtype or byte order). A push that asked and does not hand its
        cache over landed gives the blocks back: ``give_back``."""
        kv = handoff.kv
        if kv.byte_order != sys.byteorder or not self.engine.pool.takes_bytes(
                DTYPES[kv.dtype], kv.num_kv_heads, kv.head_dim):
            return None
        return self.engine.land(kv.layer_num_tokens)

    def give_back(self, landing: concurrent.futures.Future) -> None:
        """The blocks of a landing (``land``) whose push does not hand its cache over landed
        go back to the pool, once the engine has claimed them."""

        def drop(claimed: concurrent.futures.Future) -> None:
            if not claimed.cancelled() and claimed.exception() is None:
                self.engine.drop_landed(claimed.result())

        landing.add_done_callback(drop)

    def publish_pushed_first(self, stream: RequestStream, handoff: KVHandoff) -> None:
        """The chain's first token (``handoff``'s, complete) streams now, with its text unless
        stop strings decide what is released."""
        text = ""
        if not handoff.sampling.stop and self.engine.tokenizer is not None:
            text = IncrementalDecoder(self.engine.tokenizer).push(handoff.first_token_id)
        stream.pushed.prefill_s, stream.pushed.partition = handoff.prefill_s, handoff.partition
        with self._lock:
            if self._streams.get(handoff.request_id) is not stream or stream.finished:
                return  # aborted or failed since its header: its stream says so already
            stream.publish_first(handoff.first_token_id, text, time.monotonic())
        self.on_published([stream])

    def submit_pushed(self, stream: RequestStream, cache: PushedCache) -> None:
        """The checked cache of the push that announced ``stream`` joins the running set."""
        handoff = cache.handoff
        with self._lock:
            if self._streams.get(handoff.request_id) is not stream or stream.in_engine:
                # aborted, cancelled or failed since its header (its id may be another push's now)
                raise RequestAborted(f"request {handoff.request_id!r} ended before its KV arrived")
            stream.in_engine = True
            stream.pushed.push_s = time.monotonic() - stream.arrival_s
        params = dataclasses.replace(handoff.sampling, compression=handoff.compression)
        layers = cache.layers
        device = self.engine.model.device
        if device.type == "cuda" and not cache.landed:
            # through pinned memory on the copy stream, starting now: the engine steps on, and
            # the copy is (most likely) done by the time the request is admitted
            layers = to_device(layers, device)
        try:
            self.engine.add_prefilled_request(list(handoff.prompt_token_ids), layers,
                                              handoff.first_token_id, params, handoff.request_id,
                                              handoff.cache_salt)
        except Exception:
            with self._lock:
                stream.in_engine = False  # push_failed fails its stream
            raise
        self.metrics.kv_bytes_received.labels(transport=cache.transport).inc(cache.num_bytes)
        if cache.landed:
            self.metrics.kv_pushes_landed.inc()
        self.metrics.compression_ratio.observe(stream.pushed.kv_tokens_kept / stream.pushed.kv_tokens_full)

    def push_failed(self, request_id: str, error: BaseException,
                    announced: RequestStream | None = None) -> None:
        """A push for ``request_id`` failed after its header was read: the stream it
        ``announced`` (if still open) fails, or the Attach that waits for it will."""
        code = convert.status_for(error).name
        message = f"the chain's push of request {request_id!r} failed: {code}: {error}"
        record = False  # for an Attach still to come
        with self._lock:
            stream = self._streams.get(request_id)
            if announced is None:  # refused before its stream opened
                record = stream is None and request_id not in self._aborted_early
                stream = None
            elif stream is not announced or stream.in_engine:
                stream = None  # ended, replaced by a newer push, or in the engine (its own end)
            else:
                del self._streams[request_id]
                self._awaiting_attach.pop(request_id, None)
                record = not stream.attached
            if record:
                self._failed_pushes[request_id] = message
                while len(self._failed_pushes) > ABORTED_MEMORY:
                    self._failed_pushes.popitem(last=False)
        if stream is not None:
            stream.fail(message, PushLost)
            self.on_published([stream])
        self.on_change()

    def try_attach(self, request_id: str) -> RequestStream | None:
        """The stream of a pushed request, None while its cache has not arrived; a finished
        one that nobody claimed yet is still there (its steps kept for ``lease_s``)."""
        with self._lock:
            if request_id in self._aborted_early:
                raise RequestAborted(f"request {request_id!r} was aborted")
            failed = self._failed_pushes.pop(request_id, None)
            if failed is not None:
                raise PushFailed(failed)
            unclaimed = self._unclaimed.pop(request_id, None)
            if unclaimed is not None:
                unclaimed[0].attached = True
                return unclaimed[0]
            stream = self._streams.get(request_id)
            if stream is None:
                return None
            if stream.leaving:  # an earlier attempt's, on its way out: wait for the next push
                return None
            if stream.attached:
                raise RequestExists(f"request {request_id!r} is already being streamed")
            stream.attached = True
            self._awaiting_attach.pop(request_id, None)
            return stream

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV; True when this pod held (or awaited) it."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and stream.in_engine:
                stream.leaving = True
                self.engine.abort(request_id)  # its stream ends with finish reason "aborted"
                return True
            self._aborted_early[request_id] = None  # a push or attach may still be on its way
            while len(self._aborted_early) > ABORTED_MEMORY:
                self._aborted_early.popitem(last=False)
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
            self._awaiting_attach.pop(stream.request_id, None)
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
            self._step_started_s = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception as e:
                log.exception("engine step failed")
                self._fail_all(f"the decode engine failed: {e!r}")
                continue
            finally:
                step_s = time.monotonic() - self._step_started_s
                self._step_started_s = None
            self._measure_prefill(step_s)
            self._publish(outputs)
            self._expire_leases()
            self._publish_load()
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
            for gap_s in stream.publish(output, now_s):
                self.metrics.time_between_tokens_s.observe(gap_s)
            if first and stream.pushed is None:
                self.metrics.ttft_s.observe(now_s - stream.arrival_s)
            if (first or output.finished) and stream.pushed is None:
                self._settle_queued(stream)
            if output.finished:
                self.metrics.requests_finished.labels(reason=output.finish_reason).inc()
                with self._lock:
                    self._streams.pop(output.request_id, None)
                    if stream.pushed is not None and not stream.attached:
                        self._keep_unclaimed(stream, now_s)
                self.on_change()
        if touched:
            self.on_published(touched)

    def _expire_leases(self) -> None:
        """Abort the pushed requests nobody attached to within ``lease_s`` (oldest first)."""
        now_s = time.monotonic()
        expired = []
        with self._lock:
            while self._awaiting_attach:
                stream = next(iter(self._awaiting_attach.values()))
                if now_s - stream.arrival_s <= self.lease_s:
                    break
                self._awaiting_attach.popitem(last=False)
                stream.expired = True
                expired.append(stream)
        for stream in expired:
            log.warning("request %s: no Attach within %g s of its KV; freeing it",
                        stream.request_id, self.lease_s)
            self.metrics.kv_leases_expired.inc()
            if stream.in_engine:
                self.engine.abort(stream.request_id)
            else:
                self.cancel(stream.request_id)

    def _keep_unclaimed(self, stream: RequestStream, now_s: float) -> None:
        """Hold a finished pushed stream for its Attach (caller holds ``_lock``); the
        oldest go first past the lease or the cap, so nothing a caller never claims stays."""
        self._awaiting_attach.pop(stream.request_id, None)
        if not stream.expired:
            self._unclaimed[stream.request_id] = (stream, now_s)
        while self._unclaimed and (len(self._unclaimed) > ABORTED_MEMORY or
                                   now_s - next(iter(self._unclaimed.values()))[1] > self.lease_s):
            self._unclaimed.popitem(last=False)
            self.metrics.kv_leases_expired.inc()

    def _settle_queued(self, stream: RequestStream) -> None:
        """A local prompt leaves the queue once (at its first token, or when it ends first)."""
        if not stream.queued:
            return
        stream.queued = False
        with self._lock:
            self._queued_prompt_tokens -= stream.num_prompt_tokens
            self._queued_requests -= 1

    def _publish_load(self) -> None:
        scheduler = self.engine.scheduler
        pool = self.engine.pool
        waiting = list(scheduler.waiting)
        queued_tokens = sum(seq.num_uncomputed for seq in waiting + scheduler.prefilling)
        self.load = WorkerLoad(free_kv_blocks=pool.num_free_blocks, total_kv_blocks=pool.num_blocks,
                               running_sequences=scheduler.num_active,
                               queued_requests=len(waiting), queued_prompt_tokens=queued_tokens,
                               prefill_tokens_per_s=round(self._prefill_rate, 1))
        self.metrics.queued_requests.set(len(waiting))
        self.metrics.queued_prompt_tokens.set(queued_tokens)
        self.metrics.running_sequences.set(scheduler.num_active)
        self.metrics.kv_blocks_used.set(pool.num_used_blocks)
        cache = pool.prefix_cache
        if cache is not None and (cache.stats.lookups, cache.last_event) != self._prefix_mark:
            published = self._prefix_mark[1]
            self._prefix_mark = (cache.stats.lookups, cache.last_event)  # changed: admission or events
            self.metrics.record_prefix_cache(dataclasses.replace(cache.stats), cache.num_cached_blocks)
            if self.prefix_publisher is not None and cache.last_event != published:
                self._publish_prefix_events(cache, published)

    def _measure_prefill(self, step_s: float) -> None:
        """The prefill rate the pod advertises: prompt tokens over step time, decodes and all,
        averaged over the steps that prefilled (old ones fade with ``PREFILL_RATE_WEIGHT``)."""
        plan = self.engine.last_plan
        if plan is None or not plan.prefills or step_s <= 0:
            return
        rate = plan.num_prefill_tokens / step_s
        self._prefill_rate = (rate if not self._prefill_rate else
                              PREFILL_RATE_WEIGHT * rate + (1 - PREFILL_RATE_WEIGHT) * self._prefill_rate)

    def _publish_prefix_events(self, cache, published: int) -> None:
        """Hand the cache's events after ``published`` to the publisher (the engine thread's
        only part: no store call here); a snapshot when the journal no longer has them all."""
        events = cache.events_after(published)
        if not events or events[0].sequence != published + 1:
            self.prefix_publisher.offer_snapshot(cache.last_event, [h.hex() for h in cache.hashes()])
            return
        self.prefix_publisher.offer([(e.sequence, e.stored, e.hash.hex()) for e in events])

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
            self._awaiting_attach.clear()
            self._queued_prompt_tokens = 0
            self._queued_requests = 0
        for stream in streams:
            stream.fail(message, error)
        self.on_published(streams)
        self.on_change()
        return streams
