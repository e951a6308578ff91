"""The decode engine: continuous batching under a scheduling policy.

Design: ``step()`` reads as its verbs — take new requests and aborts from the
inbox, plan the iteration (``Scheduler``: policy, with ``KVManager`` for
memory), run one forward (``ModelRunner``), then sample, stream text and
retire finished sequences. Requests join and leave between iterations.

Threads: one loop thread calls ``step()``; any thread may call
``add_request``, ``add_prefilled_request`` and ``abort``: they validate at
once (raising ValueError in the caller) and hand the work over through a
thread-safe inbox that the next ``step()`` drains. ``generate()`` drives
``step()`` itself, so it is for callers that own the
engine (the CLI, tests, benchmarks), not for use beside a loop thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import Sequence as SequenceOf
from concurrent import futures

import torch

from baton.config import KVCacheConfig, KVPoolConfig, SchedulerConfig
from baton.kv.dense import LayerKV
from baton.kv.landing import Landing
from baton.kv.pool import KVPool
from baton.kv.storage import kv_storage
from baton.model.llama import CausalLM
from baton.model.tokenizer import IncrementalDecoder, Tokenizer
from baton.sampling.grammar import GrammarState
from baton.sampling.grammars import ModelGrammars
from baton.sampling.limits import check_prompt
from baton.sampling.logprobs import TokenLogprobs
from baton.sampling.params import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams
from baton.sampling.sampler import Sampler, draw
from baton.sampling.stops import StopStringMatcher
from baton.sarathi.budget import measure_token_budget
from baton.sarathi.decode_graphs import DecodeGraphs
from baton.sarathi.drivers import generate_all
from baton.sarathi.hooks import CompressorFactory, attach_compressor, compress_prompt
from baton.sarathi.memory import KVManager, build_pool
from baton.sarathi.request import GenerationResult, RequestOutput, Sequence, Status
from baton.sarathi.runner import ModelRunner
from baton.sarathi.sampling_step import draw_tokens, score_prompts
from baton.sarathi.scheduler import SchedulerOutput, create_scheduler

log = logging.getLogger(__name__)
Prompt = str | SequenceOf[int]


class Engine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None = None,
                 scheduler: SchedulerConfig | None = None, kv: KVPoolConfig | None = None,
                 compressor_factory: CompressorFactory | None = None,
                 pool: KVPool | None = None, model_revision: str = "",
                 grammars: ModelGrammars | None = None,
                 kv_cache: KVCacheConfig | None = None) -> None:
        """``model_revision``: names the weights in the prefix cache's block hashes;
        ``grammars``: the structured outputs' (default: over ``tokenizer``); ``kv_cache``:
        what the pool's blocks hold (default: the model's dtype)."""
        self.model = model
        self.tokenizer = tokenizer
        self.grammars = grammars or ModelGrammars(lambda: tokenizer, model.config.vocab_size,
                                                  model.config.eos_token_ids)
        self.compressor_factory = compressor_factory
        scheduler = scheduler or SchedulerConfig()
        self._init_pool(pool, kv or KVPoolConfig(), kv_cache or KVCacheConfig(), model_revision,
                        scheduler)
        self._init_scheduler(scheduler)
        self._init_inbox()

    def _init_pool(self, pool: KVPool | None, kv: KVPoolConfig, kv_cache: KVCacheConfig,
                   model_revision: str, scheduler: SchedulerConfig) -> None:
        followers = self.model.followers  # the other ranks of a tensor-parallel group
        storage = kv_storage(kv_cache.dtype, kv_cache.scale, self.model.dtype)
        self.pool = pool or build_pool(self.model.config, kv, self.model.dtype, self.model.device,
                                       self.model.layout.num_kv_heads, storage)
        if followers is not None:
            followers.share_pool(self.pool)
        self.memory = KVManager(self.pool, model_revision)
        graphs = None
        if scheduler.cuda_graphs and self.model.device.type == "cuda" and followers is None:
            # no step decodes more sequences than the scheduler runs at once
            graphs = DecodeGraphs(self.model, self.pool,
                                  min(scheduler.cuda_graph_max_batch, scheduler.max_running),
                                  scheduler.cuda_graph_max_context)
        self.runner = ModelRunner(self.model, self.pool, graphs)

    def _init_scheduler(self, config: SchedulerConfig) -> None:
        if config.token_budget == 0:  # auto: SARATHI's rule, timed on this model and device
            budget = measure_token_budget(self.model, config.target_iteration_ms)
            config = dataclasses.replace(config, token_budget=budget,
                                         tile_size=min(config.tile_size, budget))
        self.scheduler = create_scheduler(config, self.memory)
        self._sequences: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.num_iterations = 0
        self.num_preemptions = 0
        self.last_plan: SchedulerOutput | None = None  # what the latest step ran (metrics)

    def _init_inbox(self) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._live_ids: set[str] = set()  # accepted and not yet finished (guarded by _lock)
        self._request_counter = itertools.count()

    # --- the API (thread-safe) -------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, generated_before: int = 0,
                    cache_salt: str = "") -> str:
        """Queue a prompt (text or token ids) for local prefill and decoding; returns its id.
        ``generated_before``: the prompt ends with this many tokens generated elsewhere (a
        stream that moved here), so sampling goes on at that position. ``cache_salt``: the
        tenant's; the prefix cache shares blocks only among requests with the same one."""
        params = params or SamplingParams()
        prompt_ids = self.prompt_ids(prompt)
        self._check(prompt_ids, params)
        if not 0 <= generated_before <= len(prompt_ids):
            raise ValueError(f"generated_before {generated_before} is not within the prompt's "
                             f"{len(prompt_ids)} tokens")
        grammar = self._grammar(params, prompt_ids[len(prompt_ids) - generated_before:])
        request_id = self._claim_id(request_id)
        self._put(("add", request_id, prompt_ids, params, grammar, None, None, None,
                   generated_before, cache_salt))
        return request_id

    def add_prefilled_request(self, prompt_ids: SequenceOf[int], kv: list[LayerKV],
                              first_token: int | torch.Tensor, params: SamplingParams | None = None,
                              request_id: str | None = None, cache_salt: str = "",
                              first_logprobs: TokenLogprobs | None = None) -> str:
        """Queue a request whose prompt KV came from a prefill chain (one LayerKV per layer,
        possibly pyramid-shaped). ``first_token`` is the token the chain's tail sampled, or the
        tail's logits ([vocab]) for this request's own sampler to sample (so a seeded request
        draws the same stream as a local prefill would). It joins the running set directly;
        its first output includes the first token. A cache that ``land``-ed in the pool
        comes as its ``LandedLayer``-s. ``first_logprobs``: the sampled first token's log
        probabilities, where the request asked for them."""
        params = params or SamplingParams()
        prompt_ids = self.prompt_ids(list(prompt_ids))
        self._check(prompt_ids, params)
        if len(kv) != self.pool.num_layers:
            raise ValueError(f"prefilled KV has {len(kv)} layers, the model {self.pool.num_layers}")
        if isinstance(first_token, torch.Tensor):
            if first_token.shape != (self.model.config.vocab_size,):
                raise ValueError(f"first-token logits have shape {tuple(first_token.shape)}, "
                                 f"expected ({self.model.config.vocab_size},)")
        else:
            self._check_token(first_token, "first_token")
        grammar = self._grammar(params, ())
        request_id = self._claim_id(request_id)
        self._put(("add", request_id, prompt_ids, params, grammar, kv, first_token, first_logprobs,
                   0, cache_salt))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV; its last output has finish_reason "abort"."""
        self._put(("abort", request_id))

    def land(self, layer_num_tokens: SequenceOf[int]) -> futures.Future:
        """Claim the pool's blocks for a pushed cache still arriving, on the loop's thread
        (``KVPool.land``): the future gives the ``Landing`` (where its keys and values go)
        or why there is none. The cache is then added with ``add_prefilled_request`` as
        ``LandedLayer``-s, or the blocks given back with ``drop_landed``."""
        future: futures.Future = futures.Future()
        self._put(("land", list(layer_num_tokens), future))
        return future

    def drop_landed(self, landing: Landing) -> None:
        """Give back a landing's blocks (none once its cache was added and stored)."""
        self._put(("drop_landed", landing))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live_ids)

    def has_work(self) -> bool:
        """Unfinished requests, or messages for the loop's thread (a landing to claim)."""
        return self.has_unfinished() or not self._inbox.empty()

    def wake(self) -> None:
        """End a ``wait_for_work`` now (its caller has something else to look at)."""
        self._work.set()

    def wait_for_work(self, timeout_s: float | None = None) -> bool:
        """Block the loop thread until a request or an abort arrives (or the timeout)."""
        found = self._work.wait(timeout_s)
        self._work.clear()
        return found

    # --- one iteration ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        self._drain_inbox(outputs)
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted)
        for seq in plan.preempted:  # its recompute starts over
            attach_compressor(self.compressor_factory, seq)
        self.last_plan = plan
        for seq in plan.out_of_room:
            self._finish(seq, FINISH_LENGTH, outputs)
        if not plan.is_empty:
            self._run(plan, outputs)
        return list(outputs.values())

    def _run(self, plan: SchedulerOutput, outputs: dict[str, RequestOutput]) -> None:
        completing = [chunk.seq for chunk in plan.prefills if chunk.completes]
        sampling, logits = self.runner.execute(plan)
        self.scheduler.update(plan)
        self.num_iterations += 1
        for seq in completing:
            full = seq.prefill_end * self.pool.num_layers
            kept = compress_prompt(self.pool, seq) if seq.compressor is not None else full
            seq.kv_entries = (kept, full)
        score_prompts(logits)
        for seq, picked in zip(sampling, draw_tokens(sampling, logits)):
            if seq.samples_next:  # else the step replayed a token generated before
                self._accept_token(seq, picked.token_id, outputs, picked.logprobs)
        for seq in plan.decodes:
            if seq.compressor is not None and seq.status is Status.RUNNING:
                seq.compressor.after_decode(self.pool, seq.request_id)

    # --- convenience drivers ---------------------------------------------------------------

    def generate(self, prompts: SequenceOf[Prompt],
                 params: SamplingParams | SequenceOf[SamplingParams] | None = None
                 ) -> list[GenerationResult]:
        """Generate for every prompt (batched continuously); results in prompt order. Drives
        ``step()`` itself: for callers that own the engine (``baton.sarathi.drivers``)."""
        return generate_all(self, prompts, params)

    # --- inbox -----------------------------------------------------------------------------

    def _put(self, message: tuple) -> None:
        self._inbox.put(message)
        self._work.set()

    def _drain_inbox(self, outputs: dict[str, RequestOutput]) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = message[0]
            if kind == "add":
                self._admit_message(*message[1:], outputs)
            elif kind == "land":
                self._land(*message[1:])
            elif kind == "drop_landed":
                if self.pool.has(message[1]):
                    self.pool.free(message[1])
            elif message[1] in self._sequences:
                self._finish(self._sequences[message[1]], FINISH_ABORT, outputs)

    def _land(self, layer_num_tokens: list[int], future: futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(self.pool.land(layer_num_tokens))
        except Exception as e:  # noqa: BLE001 - the pusher learns why, and keeps its bytes
            future.set_exception(e)

    def _admit_message(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       grammar: GrammarState | None, kv: list[LayerKV] | None, first_token: int | torch.Tensor | None,
                       first_logprobs: TokenLogprobs | None, generated_before: int,
                       cache_salt: str, outputs: dict[str, RequestOutput]) -> None:
        stop_ids = params.stop_ids(self.model.config.eos_token_ids)
        own_prompt = len(prompt_ids) - generated_before  # the tokens before any was generated
        sampler = Sampler(params, prompt_ids[:own_prompt], stop_ids, prompt_ids[own_prompt:], grammar)
        decoder = None
        if self.tokenizer is not None:
            decoder = IncrementalDecoder(self.tokenizer, params.skip_special_tokens)
        seq = Sequence(request_id, prompt_ids, params, arrival=next(self._arrivals),
                       generated_before=generated_before, sampler=sampler, decoder=decoder,
                       stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output),
                       stop_ids=stop_ids, cache_salt=cache_salt)
        self._sequences[request_id] = seq
        attach_compressor(self.compressor_factory, seq)
        if kv is not None:
            seq.arrived_kv = kv
            seq.num_computed = len(prompt_ids)
            if isinstance(first_token, torch.Tensor):
                picked = draw(first_token[None, :], [seq.sampler], [seq.num_generated])[0]
                first_token, first_logprobs = picked.token_id, picked.logprobs
            self._accept_token(seq, first_token, outputs, first_logprobs)
        if seq.status is not Status.FINISHED:
            self.scheduler.add(seq)

    # --- tokens, stops, retirement ---------------------------------------------------------

    def _accept_token(self, seq: Sequence, token: int, outputs: dict[str, RequestOutput],
                      logprobs: TokenLogprobs | None = None) -> None:
        seq.output_ids.append(token)
        follows_grammar = seq.sampler.accept(token)
        output = self._output_of(seq, outputs)
        output.new_token_ids.append(token)
        if logprobs is not None:
            output.logprobs.append(logprobs)
        if seq.params.prompt_logprobs is not None and len(seq.output_ids) == 1:
            output.prompt_logprobs = seq.prompt_logprobs
        if token in seq.stop_ids or not follows_grammar:
            if not follows_grammar:
                log.error("request %s: token %d does not follow its grammar (%s); it ends here",
                          seq.request_id, token, seq.sampler.grammar.error)
            output.text_delta += self._flush_text(seq)
            self._finish(seq, FINISH_STOP, outputs)
            return
        delta = seq.decoder.push(token) if seq.decoder else ""
        emitted, stopped = seq.stop_matcher.push(delta)
        output.text_delta += emitted
        grammar = seq.sampler.grammar
        if grammar is not None and grammar.is_terminated() and not stopped:
            output.text_delta += self._flush_text(seq)  # the output is whole: nothing may follow
            stopped = True
        if stopped:
            self._finish(seq, FINISH_STOP, outputs)
        elif (len(seq.output_ids) >= seq.params.max_tokens
              or seq.num_tokens >= self.model.config.max_position_embeddings):
            output.text_delta += self._flush_text(seq)
            self._finish(seq, FINISH_LENGTH, outputs)

    def _flush_text(self, seq: Sequence) -> str:
        tail = seq.decoder.flush() if seq.decoder else ""
        emitted, stopped = seq.stop_matcher.push(tail)
        return emitted if stopped else emitted + seq.stop_matcher.flush()

    def _finish(self, seq: Sequence, reason: str, outputs: dict[str, RequestOutput]) -> None:
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        output = self._output_of(seq, outputs)
        output.finish_reason, output.kv_entries = reason, seq.kv_entries
        output.num_cached_tokens = seq.num_cached_tokens
        self._sequences.pop(seq.request_id, None)
        with self._lock:
            self._live_ids.discard(seq.request_id)

    @staticmethod
    def _output_of(seq: Sequence, outputs: dict[str, RequestOutput]) -> RequestOutput:
        if seq.request_id not in outputs:
            outputs[seq.request_id] = RequestOutput(seq.request_id, [], "")
        return outputs[seq.request_id]

    # --- validation (caller's thread) ------------------------------------------------------

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """A prompt as token ids (a text one through the tokenizer)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        return prompt_ids

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The rule every edge applies (``check_prompt``), then this engine's KV pool size."""
        config = self.model.config
        check_prompt(prompt_ids, params, config.vocab_size, config.max_position_embeddings)
        if len(prompt_ids) >= self.memory.capacity_tokens():
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the KV pool holds "
                             f"{self.memory.capacity_tokens()} tokens")

    def _grammar(self, params: SamplingParams, generated: SequenceOf[int]) -> GrammarState | None:
        """The request's grammar matcher past ``generated`` (compiled here, on the caller's
        thread: a schema that cannot be is refused at once)."""
        if params.structured is None:
            return None
        return self.grammars.state(params.structured, generated)

    def _check_token(self, token: int, what: str) -> None:
        if not 0 <= token < self.model.config.vocab_size:
            raise ValueError(f"{what} {token} is outside the vocabulary [0, {self.model.config.vocab_size})")

    def _claim_id(self, request_id: str | None) -> str:
        with self._lock:
            if request_id is None:
                request_id = f"req-{next(self._request_counter)}"
                while request_id in self._live_ids:
                    request_id = f"req-{next(self._request_counter)}"
            elif request_id in self._live_ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._live_ids.add(request_id)
        return request_id
