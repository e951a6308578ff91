from baton.api.v1 import common_pb2 as _common_pb2
from baton.api.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PushKVHeader(_message.Message):
    __slots__ = ("kv", "prompt_token_ids", "first_token_id", "sampling", "compression", "decode_incarnation", "cache_salt", "prefill_s", "partition", "first_token_follows", "first_token_logprobs")
    KV_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    DECODE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    kv: _kv_pb2.KVHeader
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _common_pb2.SamplingParams
    compression: _common_pb2.CompressionParams
    decode_incarnation: str
    cache_salt: str
    prefill_s: float
    partition: _containers.RepeatedScalarFieldContainer[int]
    first_token_follows: bool
    first_token_logprobs: _common_pb2.TokenLogprobs
    def __init__(self, kv: _Optional[_Union[_kv_pb2.KVHeader, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., compression: _Optional[_Union[_common_pb2.CompressionParams, _Mapping]] = ..., decode_incarnation: _Optional[str] = ..., cache_salt: _Optional[str] = ..., prefill_s: _Optional[float] = ..., partition: _Optional[_Iterable[int]] = ..., first_token_follows: _Optional[bool] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class PushKVFirstToken(_message.Message):
    __slots__ = ("token_id", "prefill_s", "partition", "logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    prefill_s: float
    partition: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _common_pb2.TokenLogprobs
    def __init__(self, token_id: _Optional[int] = ..., prefill_s: _Optional[float] = ..., partition: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class PushKVRequest(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "first_token", "nixl")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    header: PushKVHeader
    chunk: bytes
    trailer: PushKVTrailer
    first_token: PushKVFirstToken
    nixl: PushKVNixl
    def __init__(self, header: _Optional[_Union[PushKVHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ..., trailer: _Optional[_Union[PushKVTrailer, _Mapping]] = ..., first_token: _Optional[_Union[PushKVFirstToken, _Mapping]] = ..., nixl: _Optional[_Union[PushKVNixl, _Mapping]] = ...) -> None: ...

class PushKVNixl(_message.Message):
    __slots__ = ("agent_metadata", "addresses", "lengths")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    addresses: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, agent_metadata: _Optional[bytes] = ..., addresses: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class PushKVTrailer(_message.Message):
    __slots__ = ("checksum",)
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    checksum: int
    def __init__(self, checksum: _Optional[int] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("request_id", "bytes_received")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    bytes_received: int
    def __init__(self, request_id: _Optional[str] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class DecodeGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "compression", "generated_before", "incarnation", "cache_salt", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    GENERATED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    compression: _common_pb2.CompressionParams
    generated_before: int
    incarnation: str
    cache_salt: str
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., compression: _Optional[_Union[_common_pb2.CompressionParams, _Mapping]] = ..., generated_before: _Optional[int] = ..., incarnation: _Optional[str] = ..., cache_salt: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("request_id", "wait_s", "incarnation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    wait_s: float
    incarnation: str
    def __init__(self, request_id: _Optional[str] = ..., wait_s: _Optional[float] = ..., incarnation: _Optional[str] = ...) -> None: ...

class SessionCommand(_message.Message):
    __slots__ = ("stream", "generate", "attach", "cancel")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    stream: int
    generate: DecodeGenerateRequest
    attach: AttachRequest
    cancel: bool
    def __init__(self, stream: _Optional[int] = ..., generate: _Optional[_Union[DecodeGenerateRequest, _Mapping]] = ..., attach: _Optional[_Union[AttachRequest, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class SessionStep(_message.Message):
    __slots__ = ("stream", "step", "code", "message")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    stream: int
    step: _common_pb2.GenerateResponse
    code: int
    message: str
    def __init__(self, stream: _Optional[int] = ..., step: _Optional[_Union[_common_pb2.GenerateResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionSteps(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[SessionStep]
    def __init__(self, steps: _Optional[_Iterable[_Union[SessionStep, _Mapping]]] = ...) -> None: ...
