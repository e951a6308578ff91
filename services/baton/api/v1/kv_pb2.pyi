from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class KVHeader(_message.Message):
    __slots__ = ("request_id", "model_id", "model_revision", "dtype", "num_layers", "layer_num_tokens", "num_kv_heads", "head_dim", "byte_order", "total_bytes", "checksum_algorithm", "layout", "kv_scale")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BYTE_ORDER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_SCALE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    model_revision: str
    dtype: str
    num_layers: int
    layer_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_kv_heads: int
    head_dim: int
    byte_order: str
    total_bytes: int
    checksum_algorithm: str
    layout: str
    kv_scale: float
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., model_revision: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., layer_num_tokens: _Optional[_Iterable[int]] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., byte_order: _Optional[str] = ..., total_bytes: _Optional[int] = ..., checksum_algorithm: _Optional[str] = ..., layout: _Optional[str] = ..., kv_scale: _Optional[float] = ...) -> None: ...
