"""The leader of a tensor-parallel group: rank 0, which runs the engine, and the followers it
starts and tells what to compute.

``start_group`` spawns the N - 1 followers (one process per device), joins the group as rank 0
and loads its own shard; the model it returns tells its ``Followers`` of every forward and every
logits call before taking its own part (``CausalLM.followed``), and a pool it shares
(``share_pool``) tells them of every write and move of its storage. So the engine, the
scheduler and sampling run on this rank alone, and every rank runs the same batch.

One lock orders what the group does: a message and the collectives of the work it names go
out together, and a keepalive (a quarter of the timeout after the last message) goes out only
between them, so that an idle group's followers never time out while waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
from baton.kv.pool import KVPool
from baton.model.loader import LoadedModel
from baton.parallel.follower import GroupPlace
from baton.parallel.group import TensorParallelGroup
from baton.parallel.step import StepEncoder, pool_geometry, read_every_head
from baton.serving import free_port


class GroupDown(RuntimeError):
    """A follower died or stopped answering: the group cannot compute any more."""


class Followers:
    """The other ranks, from the leader's side (a ``StorageMirror`` for its pools)."""

    def __init__(self, group: TensorParallelGroup, loaded: LoadedModel, processes: list) -> None:
        self.group = group
        self.layout = loaded.model.layout
        self.heads = loaded.model.head_gather
        self.processes = processes
        self.encoder = StepEncoder()
        self.lock = threading.RLock()
        self.down: str | None = None
        self._last_message_s = time.monotonic()
        self._closing = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, name="baton-tp-keepalive",
                                           daemon=True)
        self._keepalive.start()

    # --- what the model and the pool call -----------------------------------------------

    @contextlib.contextmanager
    def forward(self, token_ids, positions, segments, output_rows, decode):
        """Around the leader's own forward: the followers run the same one alongside."""
        with self.lock:
            self._send(self.encoder.forward(token_ids, positions, segments, output_rows, decode))
            with self._collectives():
                yield

    @contextlib.contextmanager
    def logits(self, hidden: torch.Tensor):
        with self.lock:
            self._send(("logits", hidden.cpu()))
            with self._collectives():
                yield

    @contextlib.contextmanager
    def _collectives(self):
        """Around the leader's part of a step: a collective that failed (a follower died or
        timed out) is the group's end, not the step's."""
        try:
            yield
        except Exception as e:
            if isinstance(e, dist.DistError) or not self.alive():
                self.down = self._diagnose(e)
                raise GroupDown(f"the tensor-parallel group is down: {self.down}") from e
            raise

    def share_pool(self, pool: KVPool) -> None:
        """The followers build storage like ``pool``'s (their heads), which follows it."""
        with self.lock:
            key = len(self.encoder.pool_keys)
            self.encoder.pool_keys[id(pool.k_cache)] = key
            self._send(("pool", pool_geometry(key, pool)))
            pool.mirror = self

    def write(self, pool: KVPool, index, k, v, positions):
        with self.lock:
            self._send(("write", self.encoder.key_of(pool.k_cache), index.cpu(), k.cpu(), v.cpu(),
                        positions.cpu()))
        heads = slice(self.layout.first_kv_head, self.layout.first_kv_head + self.layout.num_kv_heads)
        return k[:, heads], v[:, heads]

    def move(self, pool: KVPool, source, target) -> None:
        with self.lock:
            self._send(("move", self.encoder.key_of(pool.k_cache), source.cpu(), target.cpu()))

    def read(self, pool: KVPool, blocks, length: int, with_values: bool):
        with self.lock:
            self._send(("read", self.encoder.key_of(pool.k_cache), blocks.cpu(), length, with_values))
            with self._collectives():
                return read_every_head(pool, self.heads, blocks, length, with_values)

    # --- the group ------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        if self.down is not None:
            raise GroupDown(f"the tensor-parallel group is down: {self.down}")
        try:
            self.group.broadcast(message)
        except Exception as e:
            self.down = self._diagnose(e)
            raise GroupDown(f"the tensor-parallel group is down: {self.down}") from e
        self._last_message_s = time.monotonic()

    def _diagnose(self, error: Exception) -> str:
        exited = [f"rank {rank} exited with code {process.returncode}"
                  for rank, process in enumerate(self.processes, start=1)
                  if process.poll() is not None]
        return "; ".join(exited) or f"a follower stopped answering ({error})"

    def _keep_alive(self) -> None:
        interval_s = self.group.timeout_s / 4
        while not self._closing.wait(min(1.0, interval_s)):
            if self.down is not None or time.monotonic() - self._last_message_s < interval_s:
                continue
            if self.lock.acquire(blocking=False):
                try:
                    self._send(("keepalive",))
                except GroupDown:
                    pass
                finally:
                    self.lock.release()

    def alive(self) -> bool:
        return self.down is None and all(process.poll() is None for process in self.processes)

    def close(self, grace_s: float = 10.0) -> None:
        """Stop the followers (a stop message, then a kill after ``grace_s``) and leave the group."""
        self._closing.set()
        if self.down is None:
            with self.lock, contextlib.suppress(GroupDown):
                self._send(("stop",))
            self.down = "closed"
        until = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.group.close()


def start_group(size: int, model: str = "", dtype: str = "auto", device: str = "auto",
                revision: str = "", max_model_len: int = 0, backend: str = "auto",
                timeout_s: float = 60.0, cpu_threads: int = 0,
                with_tokenizer: bool = True) -> tuple[LoadedModel, Followers]:
    """Start a group of ``size`` ranks serving ``model``: (this rank's LoadedModel, whose
    forwards the followers join, and the followers)."""
    port = free_port()
    places = [GroupPlace(size, rank, port, model, dtype, device, revision, max_model_len,
                         backend, timeout_s, cpu_threads=cpu_threads, with_tokenizer=with_tokenizer)
              for rank in range(size)]
    # Processes of their own (not multiprocessing's: a daemonic chain rank may not have those),
    # which leave when their leader does (their next wait on it fails).
    processes = [subprocess.Popen([sys.executable, "-m", "baton.parallel.follower",
                                   json.dumps(dataclasses.asdict(place))]) for place in places[1:]]
    try:
        group, loaded = places[0].join()
    except Exception:
        for process in processes:
            process.kill()
        raise
    followers = Followers(group, loaded, processes)
    loaded.model.followers = followers
    return loaded, followers
