"""The domain objects of baton's APIs: what a request asks for and what a server answers.

Services and engines work with these; ``baton.api.convert`` is the only place they meet the
protobuf messages of ``baton.api.v1``. Every constructor validates its values and raises
``ValueError`` naming the value (the API edge turns that into INVALID_ARGUMENT). Nothing here
imports gRPC or protobuf. Sampling parameters are the engine's own
``baton.sampling.params.SamplingParams`` (one definition, validated there).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from baton.config import KV_TRANSPORTS
from baton.configtree import require
from baton.errors import TooLarge
from baton.sampling.logprobs import TokenLogprobs
from baton.sampling.params import CompressionParams, SamplingParams

# A request id is echoed in every streamed message and stored in the routing table: long
# enough for a UUID with a prefix, short enough that it cannot inflate either.
MAX_REQUEST_ID_CHARS = 256
# What a pod accepts: a client's id plus the attempt the gateway may add ("~<n>", see
# RequestRecord.pod_request_id).
MAX_POD_REQUEST_ID_CHARS = MAX_REQUEST_ID_CHARS + 8
# A text prompt is refused before it is tokenized when it has more UTF-8 bytes than this
# many per token of the model's context: no real text averages more bytes per token, and
# tokenizing megabytes would stall the caller's server for everyone.
MAX_PROMPT_BYTES_PER_TOKEN = 32
# Where a prompt is prefilled: the gateway decides (by length and load), a prefill chain,
# or the decode pod. The tokens are the same on every route; only the time differs.
PREFILL_ROUTES = ("auto", "chain", "local")


def tenant_salt(owner: str, cache_salt: str) -> str:
    """The decode pods' prefix-cache salt of a request: its caller's identity, and the
    ``cache_salt`` it sent (the two kept apart: no pair of them collides with another)."""
    return f"{len(owner)}:{owner}{cache_salt}" if cache_salt else owner


def check_request_id(request_id: str, limit: int = MAX_REQUEST_ID_CHARS) -> None:
    require(len(request_id) <= limit,
            f"request_id is {len(request_id)} characters; at most {limit} are allowed")


def check_prompt_text(text: str, max_model_len: int) -> None:
    """Raise TooLarge (a ValueError) when a text prompt is too large to be tokenized for
    this model."""
    limit = max_model_len * MAX_PROMPT_BYTES_PER_TOKEN
    size = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise TooLarge(f"prompt text is {size} bytes; at most {limit} for a context of "
                       f"{max_model_len} tokens")


@dataclass(frozen=True)
class GenerateRequest:
    """A client's request: a prompt as text or as token ids (exactly one)."""

    request_id: str = ""  # empty = the server assigns one
    model: str = ""  # empty = the served model
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    compression: CompressionParams = field(default_factory=CompressionParams)
    prefill_route: str = "auto"  # PREFILL_ROUTES: where the prompt is prefilled
    cache_salt: str = ""  # with the caller's identity, the prefix cache's tenant

    def __post_init__(self) -> None:
        require((self.text is None) != (self.token_ids is None),
                 "a request needs a prompt as text or as token ids (exactly one)")
        require(self.prefill_route in PREFILL_ROUTES,
                f"prefill_route {self.prefill_route!r} is not one of {PREFILL_ROUTES}")
        require(bool(self.text) or bool(self.token_ids), "the prompt is empty")
        check_request_id(self.request_id)


@dataclass(frozen=True)
class PrefillRequest:
    """The gateway's request to a chain: prefill, sample the first token, push the KV."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    compression: CompressionParams
    decode_address: str
    decode_incarnation: str = ""  # of the decode pod at decode_address the gateway chose
    cache_salt: str = ""  # the caller's tenant, for the decode pod's prefix cache
    # How that pod takes pushed KV (its routing record's kv_transport): "grpc" or "nixl".
    decode_kv_transport: str = "grpc"
    traceparent: str = ""  # W3C: the gateway's span of the request ("" = not traced)

    def __post_init__(self) -> None:
        require(bool(self.request_id), "a prefill request needs a request_id")
        require(self.decode_kv_transport in KV_TRANSPORTS,
                f"decode_kv_transport {self.decode_kv_transport!r} is not one of {KV_TRANSPORTS}")
        check_request_id(self.request_id, MAX_POD_REQUEST_ID_CHARS)
        require(len(self.prompt_token_ids) > 0, "the prompt is empty")
        require(bool(self.decode_address), "a prefill request needs the decode pod's address")


@dataclass(frozen=True)
class DecodeRequest:
    """A prompt to prefill and generate on a decode pod."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    compression: CompressionParams
    generated_before: int = 0  # a moved stream: the prompt ends with this many generated tokens
    incarnation: str = ""  # of the decode pod the caller meant ("" = any)
    cache_salt: str = ""  # the caller's tenant: prefix-cache hits only within it
    traceparent: str = ""  # W3C: the caller's span of the request ("" = not traced)

    def __post_init__(self) -> None:
        require(bool(self.request_id), "a decode request needs a request_id")
        check_request_id(self.request_id, MAX_POD_REQUEST_ID_CHARS)
        require(0 <= self.generated_before <= len(self.prompt_token_ids),
                f"generated_before {self.generated_before} is not within the prompt's "
                f"{len(self.prompt_token_ids)} tokens")
        require(len(self.prompt_token_ids) > 0, "the prompt is empty")


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token, EOS or stop string
    LENGTH = "length"  # max_tokens reached
    ABORTED = "aborted"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    kv_tokens_kept: int = 0  # KV entries kept over all layers after compression
    kv_tokens_full: int = 0  # KV entries the uncompressed cache would hold
    kv_bytes_shipped: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass(frozen=True)
class Timings:
    queue_s: float = 0.0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    kv_push_s: float = 0.0
    mean_time_between_tokens_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True)
class Route:
    decode_address: str = ""
    chain_id: str = ""  # empty for a prompt prefilled on the decode pod
    partition: tuple[int, ...] = ()  # the chain's slice boundaries [0, b1, ..., C]
    reason: str = ""  # why the request took this route


@dataclass(frozen=True)
class GenerationStep:
    """One streamed message; the last has ``finish_reason`` and the summary fields set."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    route: Route | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asked for them
    # in a stream's first step, when asked for: one per prompt token after the first
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class PrefillStarted:
    """The chain started a request (its Prefill call's one message)."""

    request_id: str
    partition: tuple[int, ...]
    queue_s: float  # waited at rank 0 for the chain


@dataclass(frozen=True)
class ModelInfo:
    id: str
    revision: str
    vocab_size: int
    max_model_len: int
    num_layers: int


@dataclass(frozen=True)
class Tokenization:
    token_ids: tuple[int, ...]
    pieces: tuple[str, ...]
