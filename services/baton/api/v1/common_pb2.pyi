from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORTED: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop_token_ids", "stop_strings", "ignore_eos", "min_p", "min_tokens", "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "logprobs", "prompt_logprobs", "skip_special_tokens", "structured", "priority")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    min_p: float
    min_tokens: int
    include_stop_str_in_output: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    logprobs: int
    prompt_logprobs: int
    skip_special_tokens: bool
    structured: StructuredOutput
    priority: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "text", "strict", "any_whitespace")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    strict: bool
    any_whitespace: bool
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ..., strict: _Optional[bool] = ..., any_whitespace: _Optional[bool] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class CompressionParams(_message.Message):
    __slots__ = ("enabled", "keep_ratio")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    KEEP_RATIO_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    keep_ratio: float
    def __init__(self, enabled: _Optional[bool] = ..., keep_ratio: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "kv_tokens_kept", "kv_tokens_full", "kv_bytes_shipped", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_KEPT_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FULL_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SHIPPED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    kv_tokens_kept: int
    kv_tokens_full: int
    kv_bytes_shipped: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., kv_tokens_kept: _Optional[int] = ..., kv_tokens_full: _Optional[int] = ..., kv_bytes_shipped: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "ttft_s", "prefill_s", "kv_push_s", "mean_time_between_tokens_s", "total_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_TIME_BETWEEN_TOKENS_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    ttft_s: float
    prefill_s: float
    kv_push_s: float
    mean_time_between_tokens_s: float
    total_s: float
    def __init__(self, queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_push_s: _Optional[float] = ..., mean_time_between_tokens_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("decode_address", "chain_id", "partition", "reason")
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_ID_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    decode_address: str
    chain_id: str
    partition: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, decode_address: _Optional[str] = ..., chain_id: _Optional[str] = ..., partition: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "timings", "route", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    route: Route
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., route: _Optional[_Union[Route, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("free_kv_blocks", "total_kv_blocks", "running_sequences", "queued_requests", "queued_prompt_tokens", "prefill_tokens_per_s")
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    free_kv_blocks: int
    total_kv_blocks: int
    running_sequences: int
    queued_requests: int
    queued_prompt_tokens: int
    prefill_tokens_per_s: float
    def __init__(self, free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., running_sequences: _Optional[int] = ..., queued_requests: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
