from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KIND_UNSPECIFIED: _ClassVar[Kind]
    TENSORS: _ClassVar[Kind]
    CONTROL: _ClassVar[Kind]
    ACK: _ClassVar[Kind]
    HEARTBEAT: _ClassVar[Kind]
    ERROR: _ClassVar[Kind]
KIND_UNSPECIFIED: Kind
TENSORS: Kind
CONTROL: Kind
ACK: Kind
HEARTBEAT: Kind
ERROR: Kind

class Part(_message.Message):
    __slots__ = ("dtype", "shape", "nbytes", "checksum")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    checksum: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("name", "role", "dtype", "shape", "codec", "codec_meta", "first_payload", "parts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_META_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    codec_meta: bytes
    first_payload: int
    parts: _containers.RepeatedCompositeFieldContainer[Part]
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., codec_meta: _Optional[bytes] = ..., first_payload: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[Part, _Mapping]]] = ...) -> None: ...

class ErrorInfo(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("version", "job", "src", "dst", "kind", "seq", "step", "micro_batch", "tensors", "topic", "body", "error", "ack", "epoch", "generation", "base")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    version: int
    job: str
    src: str
    dst: str
    kind: Kind
    seq: int
    step: int
    micro_batch: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    topic: str
    body: bytes
    error: ErrorInfo
    ack: int
    epoch: int
    generation: int
    base: int
    def __init__(self, version: _Optional[int] = ..., job: _Optional[str] = ..., src: _Optional[str] = ..., dst: _Optional[str] = ..., kind: _Optional[_Union[Kind, str]] = ..., seq: _Optional[int] = ..., step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ..., topic: _Optional[str] = ..., body: _Optional[bytes] = ..., error: _Optional[_Union[ErrorInfo, _Mapping]] = ..., ack: _Optional[int] = ..., epoch: _Optional[int] = ..., generation: _Optional[int] = ..., base: _Optional[int] = ...) -> None: ...
