from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SetSpeculationRequest(_message.Message):
    __slots__ = ("enabled",)
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    def __init__(self, enabled: _Optional[bool] = ...) -> None: ...

class GetSpeculationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearSuffixIndexRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SuffixIndexState(_message.Message):
    __slots__ = ("enabled", "documents", "bytes", "max_bytes", "cleared_documents")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLEARED_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    documents: int
    bytes: int
    max_bytes: int
    cleared_documents: int
    def __init__(self, enabled: _Optional[bool] = ..., documents: _Optional[int] = ..., bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., cleared_documents: _Optional[int] = ...) -> None: ...

class SpeculationState(_message.Message):
    __slots__ = ("enabled",)
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    def __init__(self, enabled: _Optional[bool] = ...) -> None: ...

class ScalePoolRequest(_message.Message):
    __slots__ = ("pool", "replicas")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    replicas: int
    def __init__(self, pool: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class ReplaceModelRequest(_message.Message):
    __slots__ = ("pool", "model")
    POOL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    model: str
    def __init__(self, pool: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaState(_message.Message):
    __slots__ = ("name", "address", "state", "open_sessions", "routed_sessions", "model", "load", "kv_cache_usage", "has_room", "retry_in_s", "precision", "cpu_linear")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    HAS_ROOM_FIELD_NUMBER: _ClassVar[int]
    RETRY_IN_S_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    CPU_LINEAR_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    state: str
    open_sessions: int
    routed_sessions: int
    model: str
    load: float
    kv_cache_usage: float
    has_room: bool
    retry_in_s: float
    precision: str
    cpu_linear: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., open_sessions: _Optional[int] = ..., routed_sessions: _Optional[int] = ..., model: _Optional[str] = ..., load: _Optional[float] = ..., kv_cache_usage: _Optional[float] = ..., has_room: _Optional[bool] = ..., retry_in_s: _Optional[float] = ..., precision: _Optional[str] = ..., cpu_linear: _Optional[str] = ...) -> None: ...

class PoolState(_message.Message):
    __slots__ = ("pool", "desired_replicas", "min_replicas", "max_replicas", "replicas", "model", "rollout")
    POOL_FIELD_NUMBER: _ClassVar[int]
    DESIRED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    pool: str
    desired_replicas: int
    min_replicas: int
    max_replicas: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaState]
    model: str
    rollout: str
    def __init__(self, pool: _Optional[str] = ..., desired_replicas: _Optional[int] = ..., min_replicas: _Optional[int] = ..., max_replicas: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaState, _Mapping]]] = ..., model: _Optional[str] = ..., rollout: _Optional[str] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolState]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolState, _Mapping]]] = ...) -> None: ...
