"""Receiving one pushed KV cache (Decode.PushKV): header first, bytes after; the header's
first token is streamed once the header checks out, the KV enters the pool only once all
of it has.

Order of checks, cheapest first and all before the payload buffer is allocated: the stream
opens with a header; the header matches this pod's model, dtype and shape
(``baton.transfer.codec.check_header``); the prompt, the first token (on the header, or in a
message of its own once the chain's logits exist, when the tail ships each layer as it is
computed) and the sampling parameters fit the model; the pool has room for the cache right
now (else RESOURCE_EXHAUSTED at once, so the sender can pick another pod).

Then the bytes, in chunks or, from a sender that leaves them in its memory for this pod to
read over NIXL (``baton.transfer.nixl``; a pod without it refuses that with FAILED_PRECONDITION),
read into buffers of their own. ``KVAssembler`` keeps them where they arrived, counts them
and checks the checksum and the positions (``baton.transfer.received``). Meanwhile the engine
claims the cache's blocks in the pool (``Engine.land``): from then on keys and values are
copied straight into them as they arrive, while still in the CPU's cache, and the ones
kept so far follow; without that (a device pool, a landing that came too late) the pool
copies the kept bytes when the engine admits the request. Either way each byte is copied
once. A stream that ends early or fails half way lets go of what arrived, and the push
gives its landing back. A sender that stalls (no message for ``STALL_S``) is cut off with
DATA_LOSS: a push holds pool room and memory, so it cannot wait on a silent peer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from baton.config import KVTransportConfig
from baton.errors import check_incarnation
from baton.kv.dense import LayerKV
from baton.kv.landing import LandedLayer, Landing
from baton.kv.pool import KVPool, KVPoolExhausted
from baton.model.config import ModelConfig
from baton.sampling.limits import check_prompt
from baton.transfer import framing
from baton.transfer.assembler import KVAssembler
from baton.transfer.codec import KVDataLoss, KVIncompatible, KVMalformed, KVSpec, check_header
from baton.transfer.handoff import FirstToken, KVHandoff
from baton.transfer.nixl import GRPC, NIXL, NixlReader, Regions
from baton.transfer.received import ReceivedLayer

log = logging.getLogger(__name__)

STALL_S = 30.0  # the longest a pushing peer may go without sending the next message
NIXL_READ_TIMEOUT_S = KVTransportConfig.nixl_read_timeout_s  # a NIXL read of pushed bytes
# A landing that comes once more than this has arrived is given back: copying what came
# before into the blocks would hold the event loop for milliseconds; the pool copies it at
# admission instead, on the engine's thread.
LANDING_CATCH_UP_BYTES = 64 << 20


@dataclass(frozen=True)
class NixlPlane:
    """How this pod reads pushed bytes over NIXL."""

    reader: NixlReader
    timeout_s: float = NIXL_READ_TIMEOUT_S


@dataclass(frozen=True)
class Incarnation:
    """This pod's address and incarnation id, which pushed KV must name (or leave empty)."""

    address: str
    id: str


class PoolLanding:
    """The pool's blocks for one push's cache (``Engine.land``): asked for when its first
    payload bytes arrive (a push that stalls after its header claims nothing), and given
    back (``give_back``) unless the cache is handed over in them."""

    def __init__(self, request_id: str,
                 ask: Callable[[], concurrent.futures.Future | None],
                 give_back: Callable[[concurrent.futures.Future], None]) -> None:
        self.request_id = request_id
        self._ask = ask
        self._give_back = give_back
        self._asked = False
        self._future: concurrent.futures.Future | None = None

    def claim(self) -> None:
        if not self._asked:
            self._asked = True
            self._future = self._ask()

    def claimed(self) -> Landing | None:
        """The landing once the engine has claimed it; None until then, or if it could not
        (the cache then keeps its bytes until the engine admits it)."""
        future = self._future
        if future is None or not future.done():
            return None
        if future.exception() is not None:
            self._future = None
            log.info("KV for %r keeps its bytes until admitted: no landing in the pool (%s)",
                     self.request_id, future.exception())
            return None
        return future.result()

    def release(self) -> None:
        """The cache is not handed over landed: its blocks go back (once claimed)."""
        if self._future is not None:
            self._give_back(self._future)
            self._future = None


@dataclass
class PushedCache:
    handoff: KVHandoff
    layers: list[LayerKV | ReceivedLayer] | list[LandedLayer]
    num_bytes: int
    transport: str = GRPC  # the data plane that carried the bytes

    @property
    def request_id(self) -> str:
        return self.handoff.request_id

    @property
    def landed(self) -> bool:
        """Whether its keys and values are in the pool's blocks already (``LandedLayer``)."""
        return isinstance(self.layers[0], LandedLayer)


def kv_spec(model_config: ModelConfig, model_id: str, revision: str, dtype: str,
            kv_scale: float = 1.0) -> KVSpec:
    """What a pushed cache must match to enter this pod's pool (``dtype``, ``kv_scale``: what
    its blocks hold, ``baton.kv.storage``)."""
    return KVSpec(model_id=model_id, model_revision=revision, dtype=dtype, kv_scale=kv_scale,
                  num_layers=model_config.num_hidden_layers,
                  num_kv_heads=model_config.num_key_value_heads, head_dim=model_config.head_dim,
                  max_tokens=model_config.max_position_embeddings)


def check_handoff(handoff: KVHandoff, spec: KVSpec, model_config: ModelConfig,
                  incarnation: Incarnation | None = None) -> None:
    """Raise (KVMalformed / KVIncompatible / ValueError) unless the handoff suits this pod."""
    if not handoff.request_id:
        raise KVMalformed("the pushed KV header has no request_id")
    if incarnation is not None:
        check_incarnation(f"the KV of request {handoff.request_id!r}", incarnation.address,
                          incarnation.id, handoff.decode_incarnation)
    check_header(handoff.kv, spec)
    check_prompt(handoff.prompt_token_ids, handoff.sampling, model_config.vocab_size,
                 model_config.max_position_embeddings)
    if not handoff.first_token_follows:
        check_first_token(handoff.first_token_id, model_config)
    longest = max(handoff.kv.layer_num_tokens)
    if longest > len(handoff.prompt_token_ids):
        raise KVMalformed(f"a KV layer holds {longest} tokens, more than the prompt's "
                          f"{len(handoff.prompt_token_ids)}")


def check_first_token(token_id: int, model_config: ModelConfig) -> None:
    if not 0 <= token_id < model_config.vocab_size:
        raise ValueError(f"first_token_id {token_id} is outside the vocabulary "
                         f"0..{model_config.vocab_size - 1}")


def check_room(pool: KVPool, layer_num_tokens: tuple[int, ...]) -> None:
    """RESOURCE_EXHAUSTED now, rather than a cache that waits in memory for blocks."""
    needed = sum(pool.blocks_for(num_tokens) for num_tokens in layer_num_tokens)
    free = pool.num_free_blocks
    if needed > free:
        raise KVPoolExhausted(needed, free)


async def receive_header(messages: AsyncIterator, stall_s: float | None = None) -> KVHandoff:
    """The handoff a PushKV stream opens with (not yet checked: ``check_push``)."""
    return framing.header_of(await _next(messages, STALL_S if stall_s is None else stall_s))


def check_push(handoff: KVHandoff, spec: KVSpec, model_config: ModelConfig, pool: KVPool,
               incarnation: Incarnation | None = None) -> None:
    """Everything a header can be refused for, before a byte of its payload is read."""
    check_handoff(handoff, spec, model_config, incarnation)
    check_room(pool, handoff.kv.layer_num_tokens)


async def receive_body(handoff: KVHandoff, messages: AsyncIterator, spec: KVSpec,
                       stall_s: float | None = None, model_config: ModelConfig | None = None,
                       on_first_token: Callable[[KVHandoff], Awaitable[None]] | None = None,
                       nixl: NixlPlane | None = None, landing: PoolLanding | None = None
                       ) -> PushedCache:
    """The rest of a PushKV stream whose header checked out, as a checked cache (the pieces
    its bytes arrived in). When the header said the first token follows, it must come once,
    before the trailer: the handoff it completes goes to ``on_first_token`` at once, and
    with the cache. Bytes the sender left for a NIXL read are read with ``nixl``. The
    first payload bytes claim the pool's blocks for the cache (``landing``); once the
    engine has, keys and values go straight into them. A landing that fails, comes after
    ``LANDING_CATCH_UP_BYTES`` or after the last byte changes nothing."""
    stall_s = STALL_S if stall_s is None else stall_s
    checksum = None  # the trailer's: the last message
    request_id = handoff.request_id
    transport = GRPC
    with KVAssembler(handoff.kv, spec) as assembler:
        while (message := await _next(messages, stall_s)) is not None:
            if (landing is not None and assembler.landing is None
                    and (claimed := landing.claimed()) is not None):
                if assembler.bytes_received <= LANDING_CATCH_UP_BYTES:
                    assembler.land(claimed)
                else:
                    landing.release()
                    landing = None
            if checksum is not None:
                raise KVMalformed(f"PushKV stream for {request_id!r} went on after its checksum")
            part = framing.part_of(message)
            if isinstance(part, int):
                checksum = part
            elif isinstance(part, FirstToken):
                if not handoff.first_token_follows:
                    raise KVMalformed(f"PushKV stream for {request_id!r} sent a first token its "
                                      f"header did not announce (or a second one)")
                if model_config is not None:
                    check_first_token(part.token_id, model_config)
                handoff = handoff.with_first(part)
                if on_first_token is not None:
                    await on_first_token(handoff)
            elif isinstance(part, Regions):
                if nixl is None:
                    raise KVIncompatible(f"PushKV stream for {request_id!r} left its bytes for a "
                                         f"NIXL read; this decode pod takes KV over gRPC only "
                                         f"(its routing record says kv_transport grpc)")
                part.check()
                if landing is not None:
                    landing.claim()
                views = assembler.next_views(part.num_bytes)
                await nixl.reader.read(part, views, nixl.timeout_s)
                assembler.filled(views)
                transport = NIXL
            else:
                if landing is not None:
                    landing.claim()
                for piece in part:
                    assembler.add(piece)
        if handoff.first_token_follows and checksum is not None:
            raise KVMalformed(f"PushKV stream for {request_id!r} ended without the first token "
                              f"its header announced")
        layers = assembler.finish(checksum)
    last_position = len(handoff.prompt_token_ids) - 1
    for index, layer in enumerate(layers):
        if int(layer.positions[-1]) > last_position:
            raise KVMalformed(f"KV layer {index} has position {int(layer.positions[-1])}, past the "
                              f"prompt's last position {last_position}")
    return PushedCache(handoff, layers, handoff.kv.total_bytes, transport)


async def receive_cache(messages: AsyncIterator, spec: KVSpec, model_config: ModelConfig,
                        pool: KVPool, incarnation: Incarnation | None = None,
                        stall_s: float | None = None, nixl: NixlPlane | None = None
                        ) -> PushedCache:
    """Read a whole PushKV stream into a checked cache."""
    handoff = await receive_header(messages, stall_s)
    check_push(handoff, spec, model_config, pool, incarnation)
    return await receive_body(handoff, messages, spec, stall_s, model_config, nixl=nixl)


async def _next(messages: AsyncIterator, stall_s: float):
    """The stream's next message, None at its end; KVDataLoss when none comes in ``stall_s``."""
    try:
        async with asyncio.timeout(stall_s):  # no task per message, as wait_for would make
            return await anext(messages, None)
    except TimeoutError:
        raise KVDataLoss(f"the PushKV stream stalled: no message for {stall_s:g} s") from None
