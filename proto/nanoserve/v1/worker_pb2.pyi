from nanoserve.v1 import llm_pb2 as _llm_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ("num_kv_blocks", "kv_sizing")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_SIZING_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    kv_sizing: str
    def __init__(self, num_kv_blocks: _Optional[int] = ..., kv_sizing: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "rank", "world_size", "dtype", "block_size", "max_kv_blocks", "vocab_size", "max_model_len", "eos_token_ids", "attention_backend", "device", "max_num_seqs", "max_num_batched_tokens", "model_fingerprint", "max_steps_in_flight", "sampling_defaults", "kv_cache_dtype", "step_format", "weight_dtype", "quantization", "platform", "kv_sizing", "instance_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    STEP_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    KV_SIZING_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    rank: int
    world_size: int
    dtype: str
    block_size: int
    max_kv_blocks: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    attention_backend: str
    device: str
    max_num_seqs: int
    max_num_batched_tokens: int
    model_fingerprint: str
    max_steps_in_flight: int
    sampling_defaults: SamplingDefaults
    kv_cache_dtype: str
    step_format: int
    weight_dtype: str
    quantization: str
    platform: str
    kv_sizing: str
    instance_id: str
    def __init__(self, model: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., max_kv_blocks: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., attention_backend: _Optional[str] = ..., device: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., max_steps_in_flight: _Optional[int] = ..., sampling_defaults: _Optional[_Union[SamplingDefaults, _Mapping]] = ..., kv_cache_dtype: _Optional[str] = ..., step_format: _Optional[int] = ..., weight_dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., platform: _Optional[str] = ..., kv_sizing: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class SamplingDefaults(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ...) -> None: ...

class AllocateKVCacheRequest(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class AllocateKVCacheResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "forget_seq_ids", "seq_ids", "num_computed", "num_token_ids", "token_ids", "sample", "num_generated", "extras")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FORGET_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    forget_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed: _containers.RepeatedScalarFieldContainer[int]
    num_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: bytes
    sample: _containers.RepeatedScalarFieldContainer[bool]
    num_generated: _containers.RepeatedScalarFieldContainer[int]
    extras: _containers.RepeatedCompositeFieldContainer[EntryExtras]
    def __init__(self, step_id: _Optional[int] = ..., forget_seq_ids: _Optional[_Iterable[int]] = ..., seq_ids: _Optional[_Iterable[int]] = ..., num_computed: _Optional[_Iterable[int]] = ..., num_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[bytes] = ..., sample: _Optional[_Iterable[bool]] = ..., num_generated: _Optional[_Iterable[int]] = ..., extras: _Optional[_Iterable[_Union[EntryExtras, _Mapping]]] = ...) -> None: ...

class EntryExtras(_message.Message):
    __slots__ = ("entry", "new_block_ids", "reset", "sampling", "prompt_logprob_targets", "history_token_ids", "grammar")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_TARGETS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    entry: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    reset: bool
    sampling: _llm_pb2.SamplingParams
    prompt_logprob_targets: _containers.RepeatedScalarFieldContainer[int]
    history_token_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar: str
    def __init__(self, entry: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., reset: _Optional[bool] = ..., sampling: _Optional[_Union[_llm_pb2.SamplingParams, _Mapping]] = ..., prompt_logprob_targets: _Optional[_Iterable[int]] = ..., history_token_ids: _Optional[_Iterable[int]] = ..., grammar: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "token_ids", "error", "busy_seconds", "idle_seconds", "host_seconds", "sampled_logprobs", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    error: str
    busy_seconds: float
    idle_seconds: float
    host_seconds: float
    sampled_logprobs: LogprobRows
    prompt_logprobs: LogprobRows
    def __init__(self, step_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., busy_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., host_seconds: _Optional[float] = ..., sampled_logprobs: _Optional[_Union[LogprobRows, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[LogprobRows, _Mapping]] = ...) -> None: ...

class LogprobRows(_message.Message):
    __slots__ = ("token_ids", "logprobs", "ranks", "top_token_ids", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
