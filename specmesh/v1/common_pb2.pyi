from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "output_start", "logprobs")
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
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    output_start: int
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., output_start: _Optional[int] = ..., logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DenseDistribution(_message.Message):
    __slots__ = ("probs_fp16", "vocab_size")
    PROBS_FP16_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    probs_fp16: bytes
    vocab_size: int
    def __init__(self, probs_fp16: _Optional[bytes] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class TokenDistribution(_message.Message):
    __slots__ = ("sparse", "dense")
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    sparse: SparseDistribution
    dense: DenseDistribution
    def __init__(self, sparse: _Optional[_Union[SparseDistribution, _Mapping]] = ..., dense: _Optional[_Union[DenseDistribution, _Mapping]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "vocab_fingerprint", "eos_token_ids", "context_window", "device", "open_sessions", "host", "cpu_affinity", "running_sessions", "waiting_sessions", "kv_cache_usage", "queued_rows", "step_costs", "planned_step_costs", "step_model", "precision", "cpu_linear")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    CPU_AFFINITY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_COSTS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_STEP_COSTS_FIELD_NUMBER: _ClassVar[int]
    STEP_MODEL_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    CPU_LINEAR_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    vocab_fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    context_window: int
    device: str
    open_sessions: int
    host: str
    cpu_affinity: _containers.RepeatedScalarFieldContainer[int]
    running_sessions: int
    waiting_sessions: int
    kv_cache_usage: float
    queued_rows: int
    step_costs: _containers.RepeatedCompositeFieldContainer[StepCost]
    planned_step_costs: _containers.RepeatedCompositeFieldContainer[StepCost]
    step_model: StepCostModel
    precision: str
    cpu_linear: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., context_window: _Optional[int] = ..., device: _Optional[str] = ..., open_sessions: _Optional[int] = ..., host: _Optional[str] = ..., cpu_affinity: _Optional[_Iterable[int]] = ..., running_sessions: _Optional[int] = ..., waiting_sessions: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., queued_rows: _Optional[int] = ..., step_costs: _Optional[_Iterable[_Union[StepCost, _Mapping]]] = ..., planned_step_costs: _Optional[_Iterable[_Union[StepCost, _Mapping]]] = ..., step_model: _Optional[_Union[StepCostModel, _Mapping]] = ..., precision: _Optional[str] = ..., cpu_linear: _Optional[str] = ...) -> None: ...

class StepCostModel(_message.Message):
    __slots__ = ("scale", "per_session_s", "per_kilo_attended_s")
    SCALE_FIELD_NUMBER: _ClassVar[int]
    PER_SESSION_S_FIELD_NUMBER: _ClassVar[int]
    PER_KILO_ATTENDED_S_FIELD_NUMBER: _ClassVar[int]
    scale: float
    per_session_s: float
    per_kilo_attended_s: float
    def __init__(self, scale: _Optional[float] = ..., per_session_s: _Optional[float] = ..., per_kilo_attended_s: _Optional[float] = ...) -> None: ...

class StepCost(_message.Message):
    __slots__ = ("rows", "seconds")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    seconds: float
    def __init__(self, rows: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PartStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
