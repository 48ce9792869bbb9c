from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_UNSPECIFIED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_INCREMENTAL: _ClassVar[SpeculationMode]
    SPECULATION_MODE_SEQUENCE: _ClassVar[SpeculationMode]
    SPECULATION_MODE_TREE: _ClassVar[SpeculationMode]

class ChildrenRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHILDREN_RULE_UNSPECIFIED: _ClassVar[ChildrenRule]
    CHILDREN_RULE_TOP_K: _ClassVar[ChildrenRule]
    CHILDREN_RULE_SAMPLED: _ClassVar[ChildrenRule]
    CHILDREN_RULE_SAMPLED_WITHOUT_REPLACEMENT: _ClassVar[ChildrenRule]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
SPECULATION_MODE_UNSPECIFIED: SpeculationMode
SPECULATION_MODE_INCREMENTAL: SpeculationMode
SPECULATION_MODE_SEQUENCE: SpeculationMode
SPECULATION_MODE_TREE: SpeculationMode
CHILDREN_RULE_UNSPECIFIED: ChildrenRule
CHILDREN_RULE_TOP_K: ChildrenRule
CHILDREN_RULE_SAMPLED: ChildrenRule
CHILDREN_RULE_SAMPLED_WITHOUT_REPLACEMENT: ChildrenRule
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SpeculationOptions(_message.Message):
    __slots__ = ("mode", "expansion", "ssms", "children", "sequence_depth", "adaptive", "prefetch")
    MODE_FIELD_NUMBER: _ClassVar[int]
    EXPANSION_FIELD_NUMBER: _ClassVar[int]
    SSMS_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationMode
    expansion: _containers.RepeatedScalarFieldContainer[int]
    ssms: _containers.RepeatedScalarFieldContainer[str]
    children: ChildrenRule
    sequence_depth: int
    adaptive: bool
    prefetch: int
    def __init__(self, mode: _Optional[_Union[SpeculationMode, str]] = ..., expansion: _Optional[_Iterable[int]] = ..., ssms: _Optional[_Iterable[str]] = ..., children: _Optional[_Union[ChildrenRule, str]] = ..., sequence_depth: _Optional[int] = ..., adaptive: _Optional[bool] = ..., prefetch: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "speculation")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculation: SpeculationOptions
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[SpeculationOptions, _Mapping]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("mode", "target_steps", "new_tokens", "tokens_per_step", "ms_per_token", "draft_ms", "verify_ms", "total_ms", "draft_tokens", "accepted_tokens", "accepted_per_ssm", "accepted_per_depth", "hop_ms", "tree_sizes", "prefetch_hits", "prefetch_misses", "prefetch_saved_ms", "drafted_through_text", "survived_through_text")
    class AcceptedPerSsmEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class HopMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class DraftedThroughTextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SurvivedThroughTextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_SSM_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_DEPTH_FIELD_NUMBER: _ClassVar[int]
    HOP_MS_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_MISSES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_SAVED_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_THROUGH_TEXT_FIELD_NUMBER: _ClassVar[int]
    SURVIVED_THROUGH_TEXT_FIELD_NUMBER: _ClassVar[int]
    mode: str
    target_steps: int
    new_tokens: int
    tokens_per_step: float
    ms_per_token: float
    draft_ms: float
    verify_ms: float
    total_ms: float
    draft_tokens: int
    accepted_tokens: int
    accepted_per_ssm: _containers.ScalarMap[str, int]
    accepted_per_depth: _containers.RepeatedScalarFieldContainer[int]
    hop_ms: _containers.ScalarMap[str, float]
    tree_sizes: _containers.RepeatedScalarFieldContainer[int]
    prefetch_hits: int
    prefetch_misses: int
    prefetch_saved_ms: float
    drafted_through_text: _containers.ScalarMap[str, int]
    survived_through_text: _containers.ScalarMap[str, int]
    def __init__(self, mode: _Optional[str] = ..., target_steps: _Optional[int] = ..., new_tokens: _Optional[int] = ..., tokens_per_step: _Optional[float] = ..., ms_per_token: _Optional[float] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_ssm: _Optional[_Mapping[str, int]] = ..., accepted_per_depth: _Optional[_Iterable[int]] = ..., hop_ms: _Optional[_Mapping[str, float]] = ..., tree_sizes: _Optional[_Iterable[int]] = ..., prefetch_hits: _Optional[int] = ..., prefetch_misses: _Optional[int] = ..., prefetch_saved_ms: _Optional[float] = ..., drafted_through_text: _Optional[_Mapping[str, int]] = ..., survived_through_text: _Optional[_Mapping[str, int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...
