from baton.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "sampling", "compression", "decode_address", "decode_incarnation", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    compression: _common_pb2.CompressionParams
    decode_address: str
    decode_incarnation: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., compression: _Optional[_Union[_common_pb2.CompressionParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., decode_incarnation: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillFirstToken(_message.Message):
    __slots__ = ("token_id", "ttft_s", "partition")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    ttft_s: float
    partition: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_id: _Optional[int] = ..., ttft_s: _Optional[float] = ..., partition: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillShipped(_message.Message):
    __slots__ = ("kv_bytes", "kv_tokens_kept", "kv_tokens_full", "prefill_s", "kv_push_s")
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_KEPT_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FULL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_S_FIELD_NUMBER: _ClassVar[int]
    kv_bytes: int
    kv_tokens_kept: int
    kv_tokens_full: int
    prefill_s: float
    kv_push_s: float
    def __init__(self, kv_bytes: _Optional[int] = ..., kv_tokens_kept: _Optional[int] = ..., kv_tokens_full: _Optional[int] = ..., prefill_s: _Optional[float] = ..., kv_push_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token", "shipped")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHIPPED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: PrefillFirstToken
    shipped: PrefillShipped
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[_Union[PrefillFirstToken, _Mapping]] = ..., shipped: _Optional[_Union[PrefillShipped, _Mapping]] = ...) -> None: ...
