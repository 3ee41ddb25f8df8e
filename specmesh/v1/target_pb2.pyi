from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_SOURCE_UNSPECIFIED: _ClassVar[DraftSource]
    DRAFT_SOURCE_DRAFT_MODEL: _ClassVar[DraftSource]
    DRAFT_SOURCE_PROMPT_LOOKUP: _ClassVar[DraftSource]
    DRAFT_SOURCE_SUFFIX_INDEX: _ClassVar[DraftSource]

class NextTokenKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NEXT_TOKEN_KIND_UNSPECIFIED: _ClassVar[NextTokenKind]
    NEXT_TOKEN_KIND_RECOVERED: _ClassVar[NextTokenKind]
    NEXT_TOKEN_KIND_BONUS: _ClassVar[NextTokenKind]
DRAFT_SOURCE_UNSPECIFIED: DraftSource
DRAFT_SOURCE_DRAFT_MODEL: DraftSource
DRAFT_SOURCE_PROMPT_LOOKUP: DraftSource
DRAFT_SOURCE_SUFFIX_INDEX: DraftSource
NEXT_TOKEN_KIND_UNSPECIFIED: NextTokenKind
NEXT_TOKEN_KIND_RECOVERED: NextTokenKind
NEXT_TOKEN_KIND_BONUS: NextTokenKind

class TargetOpenRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "resume", "max_new_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    resume: bool
    max_new_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., resume: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class TargetOpenResponse(_message.Message):
    __slots__ = ("request_id", "token_id", "committed_length", "forward_ns", "logprob")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    committed_length: int
    forward_ns: int
    logprob: _common_pb2.TokenLogprob
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., committed_length: _Optional[int] = ..., forward_ns: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("request_id", "round", "position", "draft_token_ids", "draft_distributions", "draft_source", "alternatives", "trace_context", "decode_ahead")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DECODE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    position: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenDistribution]
    draft_source: DraftSource
    alternatives: _containers.RepeatedCompositeFieldContainer[DraftAlternative]
    trace_context: _containers.ScalarMap[str, str]
    decode_ahead: int
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., position: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_common_pb2.TokenDistribution, _Mapping]]] = ..., draft_source: _Optional[_Union[DraftSource, str]] = ..., alternatives: _Optional[_Iterable[_Union[DraftAlternative, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., decode_ahead: _Optional[int] = ...) -> None: ...

class DraftAlternative(_message.Message):
    __slots__ = ("index", "token_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_id: int
    def __init__(self, index: _Optional[int] = ..., token_id: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("request_id", "round", "accepted_count", "next_token_id", "next_token_kind", "committed_length", "forward_ns", "logprobs", "after_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_KIND_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    AFTER_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    accepted_count: int
    next_token_id: int
    next_token_kind: NextTokenKind
    committed_length: int
    forward_ns: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    after_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., accepted_count: _Optional[int] = ..., next_token_id: _Optional[int] = ..., next_token_kind: _Optional[_Union[NextTokenKind, str]] = ..., committed_length: _Optional[int] = ..., forward_ns: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., after_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyBatch(_message.Message):
    __slots__ = ("batch_id", "parts")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    parts: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, batch_id: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class VerifyPart(_message.Message):
    __slots__ = ("index", "response", "error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    response: VerifyResponse
    error: _common_pb2.PartStatus
    def __init__(self, index: _Optional[int] = ..., response: _Optional[_Union[VerifyResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.PartStatus, _Mapping]] = ...) -> None: ...

class VerifyBatchResult(_message.Message):
    __slots__ = ("batch_id", "parts")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    parts: _containers.RepeatedCompositeFieldContainer[VerifyPart]
    def __init__(self, batch_id: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[VerifyPart, _Mapping]]] = ...) -> None: ...
