"""A prefill chain of local processes behind a Python API (``baton generate --chain-ranks``,
the tuner, the benchmark and the tests).

``LocalChain`` spawns p processes (``torch.multiprocessing``, spawn) that form
one gloo/NCCL group and serve until closed. The parent validates every request
before it reaches rank 0 (bad input is a ValueError and the chain keeps
serving), sends it down a queue to rank 0 and waits for the tail's result on a
queue back. The wait is bounded: a rank that dies is seen by its exit code, a
rank that hangs makes its neighbours time out inside the backend, and either
way the parent raises ``ChainError`` naming the ranks; the chain is then down.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable
from typing import Self

import torch
import torch.multiprocessing as mp

from baton.config import ChainConfig, ModelSourceConfig
from baton.runahead.errors import ChainError
from baton.runahead.partition import even_boundaries
from baton.runahead.request import ChainRequest, ChainResult, ModelSource, make_request
from baton.runahead.table import PartitionTable
from baton.runahead.worker import ChainRank, CompressingObserver, StopChain, local_backend
from baton.serving import free_port

FAILURE_GRACE_S = 1.0  # after the first failure, how long to collect the other ranks' reports


class QueueSource:
    """Rank 0's requests from the parent; None on the queue, or the parent's death, stops the chain."""

    def __init__(self, inbox) -> None:
        self.inbox = inbox
        self.parent_pid = os.getppid()

    def next_request(self, timeout_s: float) -> ChainRequest | None:
        if os.getppid() != self.parent_pid:  # orphaned: nobody is left to send requests
            raise StopChain()
        try:
            request = self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if request is None:
            raise StopChain()
        return request


class QueueSink:
    """Every rank's reports to the parent: ("ready",), ("result", ChainResult), ("fail", rank, text)."""

    def __init__(self, outbox) -> None:
        self.outbox = outbox

    def ready(self) -> None:
        self.outbox.put(("ready",))

    def deliver(self, result: ChainResult) -> None:
        self.outbox.put(("result", result.on_host()))

    def fail(self, rank: int, request_id: int, message: str) -> None:
        self.outbox.put(("fail", rank, message))


def _rank_main(config: ChainConfig, model_source: ModelSource, inbox, outbox,
               make_observer: Callable[[int], CompressingObserver] | None,
               tensor_parallel_size: int = 1) -> None:
    sink = QueueSink(outbox)
    try:
        rank = ChainRank(config, model_source, sink, QueueSource(inbox) if config.rank == 0 else None,
                         make_observer, gather_counters=True,  # benchmarks and tests read them
                         tensor_parallel_size=tensor_parallel_size)
    except Exception as e:  # noqa: BLE001 - the process boundary: whatever stopped the rank is reported
        sink.fail(config.rank, -1, f"rank {config.rank}: could not join the chain: {e}")
        _exit(outbox, 1)
    try:
        rank.serve()
    except Exception:  # noqa: BLE001 - serve() has reported it to the sink already
        _exit(outbox, 1)
    _exit(outbox, 0)


def _exit(outbox, code: int) -> None:
    """Flush the reports, then leave without running a broken process group's teardown."""
    outbox.close()
    outbox.join_thread()
    os._exit(code)



class LocalChain:
    """p local processes serving prefill requests; use as a context manager."""

    def __init__(self, model_source: ModelSource, ranks: int, table: PartitionTable | None = None,
                 timeout_s: float = ChainConfig.timeout_s, backend: str = ChainConfig.backend,
                 make_observer: Callable[[int], CompressingObserver] | None = None,
                 start_timeout_s: float = 300.0, tensor_parallel_size: int = 1) -> None:
        """``tensor_parallel_size``: each rank's model sharded over that many processes."""
        self.model_source = model_source
        self.model_config = model_source.config()
        self.num_ranks = ranks
        self.table = table
        self.timeout_s = timeout_s
        self._validate_table()
        self.down: str | None = None  # why the chain stopped serving
        self._next_id = 0
        self._init_processes(backend, make_observer, tensor_parallel_size)
        self._wait_ready(start_timeout_s)

    def _validate_table(self) -> None:
        ChainConfig(ranks=self.num_ranks, timeout_s=self.timeout_s)  # raises ValueError on bad values
        if self.table is not None:
            self.table.require_ranks(self.num_ranks)

    def _init_processes(self, backend: str, make_observer, tensor_parallel_size: int) -> None:
        backend = local_backend(backend, self.num_ranks)
        context = mp.get_context("spawn")
        self.inbox, self.outbox = context.Queue(), context.Queue()
        port = free_port()
        self.processes = []
        for rank in range(self.num_ranks):
            config = ChainConfig(ranks=self.num_ranks, rank=rank, master_port=port, backend=backend,
                                 timeout_s=self.timeout_s)
            process = context.Process(target=_rank_main, name=f"baton-chain-rank-{rank}",
                                      args=(config, self.model_source, self.inbox, self.outbox,
                                            make_observer, tensor_parallel_size), daemon=True)
            process.start()
            self.processes.append(process)

    def _wait_ready(self, timeout_s: float) -> None:
        message = self._next_message(time.monotonic() + timeout_s, "to start")
        assert message[0] == "ready", f"unexpected first message {message[0]!r}"

    # --- requests -----------------------------------------------------------------------

    def boundaries_for(self, context_length: int, mode: str) -> list[int]:
        """The partition a request gets: the table's for KV-Runahead when there is one, else even."""
        if mode == "runahead" and self.table is not None:
            return self.table.boundaries(self.num_ranks, context_length)
        return even_boundaries(context_length, self.num_ranks)

    def prefill(self, token_ids, boundaries: list[int] | None = None, mode: str = "runahead",
                return_kv: bool = True) -> ChainResult:
        """Run one prompt through the chain and return the tail's result (raises ChainError)."""
        if self.down is not None:
            raise ChainError(f"the chain is down: {self.down}")
        context_length = torch.as_tensor(token_ids).numel()
        if boundaries is None and context_length:
            boundaries = self.boundaries_for(context_length, mode)
        request = make_request(self._next_id, token_ids, self.num_ranks, self.model_config,
                               boundaries, mode, return_kv)
        self._next_id += 1
        self.inbox.put(request)
        while True:
            message = self._next_message(None, f"to finish request {request.request_id}")
            if message[0] == "result" and message[1].request_id == request.request_id:
                return message[1]

    def _next_message(self, deadline: float | None, what: str) -> tuple:
        """The next report from a rank; raises ChainError once a rank fails, dies or ``deadline`` passes."""
        while True:
            try:
                message = self.outbox.get(timeout=0.1)
            except queue.Empty:
                if any(p.exitcode is not None for p in self.processes):
                    self._fail({})
                if deadline is not None and time.monotonic() > deadline:
                    self._fail({-1: f"the chain took too long {what}"})
                continue
            if message[0] == "fail":
                self._fail({message[1]: message[2]})
            return message

    def _fail(self, reports: dict[int, str]) -> None:
        """Collect what the other ranks say for a moment, shut the chain down and raise.

        A collective that times out cannot tell which peer is at fault, so the
        diagnosis also names the ranks that died and those that are alive but
        said nothing: the ones that stopped responding.
        """
        until = time.monotonic() + FAILURE_GRACE_S
        while time.monotonic() < until:
            try:
                message = self.outbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if message[0] == "fail":
                reports[message[1]] = message[2]
        # The dead first (the likeliest cause), then the silent: on a busy machine a survivor
        # may not have reported its failed wait within the grace.
        exited = [f"rank {rank} exited with code {process.exitcode}"
                  for rank, process in enumerate(self.processes) if process.exitcode not in (None, 1)]
        silent = [f"rank {rank} stopped responding" for rank, process in enumerate(self.processes)
                  if process.exitcode is None and rank not in reports]
        self.down = "; ".join(exited + silent + [reports[rank] for rank in sorted(reports)])
        self._stop_processes(grace_s=0.0)  # the chain is broken: survivors may be stuck in a wait
        raise ChainError(f"prefill chain failed: {self.down}")

    # --- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        if self.down is None:
            self.inbox.put(None)
            self.down = "closed"
        self._stop_processes()

    def _stop_processes(self, grace_s: float = 10.0) -> None:
        until = time.monotonic() + grace_s
        for process in self.processes:
            process.join(max(0.0, until - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prefill_with_local_chain(model_path: str, token_ids, ranks: int, mode: str = ChainConfig.mode,
                             table: PartitionTable | None = None,
                             timeout_s: float = ChainConfig.timeout_s,
                             dtype: str = ModelSourceConfig.dtype) -> ChainResult:
    """Prefill one prompt on a fresh local chain (``baton generate --chain-ranks P``).

    The result's ``first_token_logits`` and ``layers`` (the full cache, original
    positions) continue into any decoder: ``KVPool.store(seq_id, result.layers)``.
    """
    with LocalChain(ModelSource(path=model_path, dtype=dtype), ranks, table=table, timeout_s=timeout_s) as chain:
        return chain.prefill(token_ids, mode=mode)
