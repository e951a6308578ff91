"""The routing store: which workers exist, how loaded they are, and where each request lives.

Design: routing state is disposable. Every worker writes its own record under a key with a
TTL and refreshes it by heartbeat, so a dead worker disappears by itself; the gateway
records where each request lives (for abort and recovery), also with a TTL. Records are
JSON (never pickle), so anything that speaks Redis can read them.

Decode pods also publish what their prefix caches hold, for cache-aware routing: a stream of
numbered events per pod process (a block stored or evicted, named by its hash), bounded and
expiring, and now and then a snapshot of every hash held; a reader that finds a gap in the
numbers (it fell behind the bound) starts again from the snapshot.

Two implementations share this interface and one test suite: ``RedisStore`` for a cluster
and ``InMemoryStore`` for a single process. ``StoreUnavailable`` is the one error a caller
has to handle: the store cannot be reached right now (callers keep their last view).
"""

from __future__ import annotations

import abc
import json
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields

from baton.errors import Unavailable
from baton.kv.contract import KVContract

ROLES = ("prefill", "decode", "gateway")
MAX_PREFIX_EVENTS = 65536  # a pod's prefix-cache events the store keeps (older ones are dropped)

# One prefix-cache event: (its number, from 1 per pod process; True = stored, False = evicted;
# the block's hash in hex)
PrefixEvent = tuple[int, bool, str]


class StoreUnavailable(Unavailable, RuntimeError):
    """The routing store cannot be reached (Redis down or timing out)."""


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's live load, refreshed with every heartbeat."""

    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    running_sequences: int = 0
    queued_requests: int = 0
    queued_prompt_tokens: int = 0
    # Prompt tokens a second the pod's recent steps computed, decodes riding along (a
    # moving average over the steps that prefilled; 0 = none yet): what a cache-aware
    # router divides the tokens left to prefill by.
    prefill_tokens_per_s: float = 0.0


@dataclass(frozen=True)
class WorkerInfo:
    """One worker's routing record; ``worker_id`` is its key (unique per deployment)."""

    worker_id: str
    role: str
    address: str  # host:port its gRPC server is reachable at
    model_id: str
    model_revision: str
    version: str  # the baton release the worker runs
    chain_id: str = ""  # prefill ranks: the chain they belong to
    rank: int = 0
    num_ranks: int = 1
    load: WorkerLoad = field(default_factory=WorkerLoad)
    # The dtype of the KV caches it computes (decode pods and chains), as in ``kv_contract``
    # (kept for gateways of earlier releases, which read only this). "" = not said (any).
    kv_dtype: str = ""
    # Prefill chains: the shortest prompt their partition table measured the chain to
    # prefill faster than one process (KV-Runahead's break-even); 0 = not measured.
    break_even_tokens: int = 0
    # This process's id, new at every start: work routed to an earlier process on the same
    # address is refused instead of landing on a stranger (FAILED_PRECONDITION).
    incarnation: str = ""
    # Decode pods with a prefix cache: tokens per KV block (0 = no cache); the cache's
    # events are published under ``prefix_stream``.
    kv_block_size: int = 0
    # Decode pods: how they take pushed KV: "grpc", or "nixl" (over NIXL as well as gRPC).
    kv_transport: str = "grpc"
    # Decode pods and chains: the KV they take or ship (``baton.kv.contract``); None in
    # a record of an earlier release, which ``contract`` reads from the fields above.
    kv_contract: KVContract | None = None

    @property
    def contract(self) -> KVContract:
        """The KV contract this worker publishes, or what a record without one says of it."""
        if self.kv_contract is not None:
            return self.kv_contract
        return KVContract(self.model_id, self.model_revision, dtype=self.kv_dtype)

    @property
    def prefix_stream(self) -> str:
        """The name of this process's prefix-cache event stream in the store."""
        return f"{self.worker_id}:{self.incarnation}"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker role {self.role!r} is not one of {ROLES}")
        if not self.worker_id or not self.address:
            raise ValueError(f"a worker needs an id and an address, got {self.worker_id!r} "
                             f"and {self.address!r}")
        if not 0 <= self.rank < self.num_ranks:
            raise ValueError(f"worker rank {self.rank} is outside 0..{self.num_ranks - 1}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerInfo:
        """A record; fields this release does not know (a newer worker's, during a rolling
        upgrade) are left out rather than refused."""
        fields = _known(cls, json.loads(text))
        fields["load"] = WorkerLoad(**_known(WorkerLoad, fields.get("load", {})))
        if fields.get("kv_contract") is not None:
            fields["kv_contract"] = KVContract(**_known(KVContract, fields["kv_contract"]))
        return cls(**fields)


@dataclass(frozen=True)
class RequestRecord:
    """Where a request lives: every pod that holds state for it."""

    request_id: str
    decode_address: str
    chain_id: str = ""  # empty when the prompt is prefilled on the decode pod
    prefill_address: str = ""
    created_at: float = 0.0  # wall-clock seconds (time.time()) when the gateway admitted it
    owner: str = ""  # the API key's name the request came with ("" when the gateway has no keys)
    attempt: int = 0  # how many times a chain failed it and it was sent to a chain again

    @property
    def pod_request_id(self) -> str:
        """The id the pods know the request by. Each chain attempt has its own, so nothing
        an earlier attempt left on a decode pod (an Attach whose cancel is still on its way,
        a stream it opened) can hold the id the next attempt's push and Attach use."""
        return f"{self.request_id}~{self.attempt}" if self.attempt else self.request_id

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RequestRecord:
        """A record; as ``WorkerInfo.from_json``, unknown fields are left out (and fields a
        gateway of an earlier release did not write take their defaults)."""
        return cls(**_known(cls, json.loads(text)))


class RoutingStore(abc.ABC):
    """Workers and requests with TTLs. Every method may raise ``StoreUnavailable``."""

    @abc.abstractmethod
    def register_worker(self, worker: WorkerInfo, ttl_s: float) -> None:
        """Write (or refresh) a worker's record; it vanishes ``ttl_s`` after the last write."""

    @abc.abstractmethod
    def remove_worker(self, worker_id: str) -> None:
        """Drop a worker's record now (a clean shutdown)."""

    @abc.abstractmethod
    def list_workers(self, role: str | None = None) -> list[WorkerInfo]:
        """The live workers (of one role), sorted by worker_id."""

    @abc.abstractmethod
    def put_request(self, record: RequestRecord, ttl_s: float, if_absent: bool = False) -> bool:
        """Record where a request lives; with ``if_absent`` only when no live record has its
        id. Returns whether it was written."""

    @abc.abstractmethod
    def get_request(self, request_id: str) -> RequestRecord | None:
        """The live record of a request, or None."""

    @abc.abstractmethod
    def remove_request(self, request_id: str) -> None:
        """Forget a finished or aborted request."""

    @abc.abstractmethod
    def append_prefix_events(self, stream: str, events: list[PrefixEvent], ttl_s: float) -> None:
        """Add a pod's prefix-cache events (numbered in order, after those already there); the
        stream keeps the last ``MAX_PREFIX_EVENTS`` and expires ``ttl_s`` after the last write."""

    @abc.abstractmethod
    def read_prefix_events(self, stream: str, after: int, limit: int) -> list[PrefixEvent]:
        """Up to ``limit`` events numbered above ``after``, in order (none for an unknown or
        expired stream)."""

    @abc.abstractmethod
    def put_prefix_snapshot(self, stream: str, upto: int, hashes: list[str], ttl_s: float) -> None:
        """Every hash the pod's cache holds after its event ``upto``."""

    @abc.abstractmethod
    def get_prefix_snapshot(self, stream: str) -> tuple[int, list[str]] | None:
        """The latest snapshot (upto, hashes), or None."""

    def close(self) -> None:
        """Release connections (nothing to do by default)."""


def _known(cls: type, fields: dict) -> dict:
    """``fields`` without the names ``cls`` does not have: records written by another release
    of baton stay readable across a rolling upgrade."""
    names = {f.name for f in dataclass_fields(cls)}
    return {name: value for name, value in fields.items() if name in names}


def check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:
        raise ValueError(f"a routing TTL must be > 0 seconds, got {ttl_s}")
