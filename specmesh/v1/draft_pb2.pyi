from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftOpenRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "max_new_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    max_new_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class DraftOpenResponse(_message.Message):
    __slots__ = ("request_id", "length", "forward_ns")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    length: int
    forward_ns: int
    def __init__(self, request_id: _Optional[str] = ..., length: _Optional[int] = ..., forward_ns: _Optional[int] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("position", "token_ids")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("request_id", "round", "commit", "position", "num_tokens", "stop_below", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_BELOW_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    commit: Commit
    position: int
    num_tokens: int
    stop_below: float
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., position: _Optional[int] = ..., num_tokens: _Optional[int] = ..., stop_below: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("request_id", "round", "position", "token_ids", "distributions", "forward_ns", "probabilities", "alternative_token_ids", "alternative_probabilities")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVE_PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenDistribution]
    forward_ns: int
    probabilities: _containers.RepeatedScalarFieldContainer[float]
    alternative_token_ids: _containers.RepeatedScalarFieldContainer[int]
    alternative_probabilities: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[_common_pb2.TokenDistribution, _Mapping]]] = ..., forward_ns: _Optional[int] = ..., probabilities: _Optional[_Iterable[float]] = ..., alternative_token_ids: _Optional[_Iterable[int]] = ..., alternative_probabilities: _Optional[_Iterable[float]] = ...) -> None: ...

class PreDraftRequest(_message.Message):
    __slots__ = ("request_id", "round", "commit", "position", "assumed_token_ids", "num_tokens", "extra_branches", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    commit: Commit
    position: int
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    extra_branches: int
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., position: _Optional[int] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., extra_branches: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DraftBranch(_message.Message):
    __slots__ = ("request_id", "round", "accepted_count", "next_token_id", "position", "token_ids", "distributions", "forward_ns", "planned_accepted_counts", "planned_next_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_ACCEPTED_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    accepted_count: int
    next_token_id: int
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenDistribution]
    forward_ns: int
    planned_accepted_counts: _containers.RepeatedScalarFieldContainer[int]
    planned_next_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., accepted_count: _Optional[int] = ..., next_token_id: _Optional[int] = ..., position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[_common_pb2.TokenDistribution, _Mapping]]] = ..., forward_ns: _Optional[int] = ..., planned_accepted_counts: _Optional[_Iterable[int]] = ..., planned_next_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeBatch(_message.Message):
    __slots__ = ("batch_id", "parts", "predrafts")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    parts: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    predrafts: _containers.RepeatedCompositeFieldContainer[PreDraftRequest]
    def __init__(self, batch_id: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ..., predrafts: _Optional[_Iterable[_Union[PreDraftRequest, _Mapping]]] = ...) -> None: ...

class BranchPart(_message.Message):
    __slots__ = ("index", "branch", "error", "last")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    index: int
    branch: DraftBranch
    error: _common_pb2.PartStatus
    last: bool
    def __init__(self, index: _Optional[int] = ..., branch: _Optional[_Union[DraftBranch, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.PartStatus, _Mapping]] = ..., last: _Optional[bool] = ...) -> None: ...

class ProposePart(_message.Message):
    __slots__ = ("index", "response", "error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    response: ProposeResponse
    error: _common_pb2.PartStatus
    def __init__(self, index: _Optional[int] = ..., response: _Optional[_Union[ProposeResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.PartStatus, _Mapping]] = ...) -> None: ...

class ProposeBatchResult(_message.Message):
    __slots__ = ("batch_id", "parts", "branches")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    parts: _containers.RepeatedCompositeFieldContainer[ProposePart]
    branches: _containers.RepeatedCompositeFieldContainer[BranchPart]
    def __init__(self, batch_id: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[ProposePart, _Mapping]]] = ..., branches: _Optional[_Iterable[_Union[BranchPart, _Mapping]]] = ...) -> None: ...
