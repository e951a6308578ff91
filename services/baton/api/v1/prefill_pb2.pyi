from baton.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "sampling", "compression", "decode_address", "decode_incarnation", "cache_salt", "decode_kv_transport", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DECODE_KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    compression: _common_pb2.CompressionParams
    decode_address: str
    decode_incarnation: str
    cache_salt: str
    decode_kv_transport: str
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., compression: _Optional[_Union[_common_pb2.CompressionParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., decode_incarnation: _Optional[str] = ..., cache_salt: _Optional[str] = ..., decode_kv_transport: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...

class PrefillStarted(_message.Message):
    __slots__ = ("partition", "queue_s")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    partition: _containers.RepeatedScalarFieldContainer[int]
    queue_s: float
    def __init__(self, partition: _Optional[_Iterable[int]] = ..., queue_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "started")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    started: PrefillStarted
    def __init__(self, request_id: _Optional[str] = ..., started: _Optional[_Union[PrefillStarted, _Mapping]] = ...) -> None: ...
