"""The gRPC messages <-> engine values: request checks with field-level errors, responses, stats.

No Ray here: the ingress (``cluster.serve_app``) calls these around its actor calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from engine.requests import MAX_PREFETCH, GenerationRequest, GenerationStats, SpeculationOptions
from engine.step import plan_proposers
from engine.sampling import MIN_TEMPERATURE, MIN_TOP_P, SamplingParams
from protos import specinfer_pb2 as pb

from settings.config import EngineConfig, ServerConfig

MODES = {pb.SPECULATION_MODE_INCREMENTAL: "incremental", pb.SPECULATION_MODE_SEQUENCE: "sequence",
         pb.SPECULATION_MODE_TREE: "tree"}
CHILDREN = {pb.CHILDREN_RULE_TOP_K: "top_k", pb.CHILDREN_RULE_SAMPLED: "sampled",
            pb.CHILDREN_RULE_SAMPLED_WITHOUT_REPLACEMENT: "sampled_without_replacement"}
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "cancelled": pb.FINISH_REASON_CANCELLED}
MAX_EXPANSION_DEPTH, MAX_EXPANSION_WIDTH, MAX_SEQUENCE_DEPTH = 32, 64, 32
MAX_MESSAGE_CHARS = 1000  # error details quote values; a gRPC status must fit in the trailers


class InvalidArgument(ValueError):
    """A request field out of range; ``str()`` names the field and what is allowed."""

    def __init__(self, field: str, message: str):
        message = shorten(message)
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def __reduce__(self):  # picklable: Ray ships it from the replica to the proxy
        return type(self), (self.field, self.message)


def shorten(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """An error message cut to ``limit`` characters (it may quote a huge value)."""
    return message if len(message) <= limit else f"{message[:limit - 15]}... ({len(message)} chars)"


@dataclass(frozen=True)
class ModelLimits:
    """What the ingress knows about the deployed models when it checks a request."""

    names: tuple[str, ...]  # proposers in engine order
    neural: tuple[bool, ...]
    max_context: int | None  # the target's context (prompt + new tokens), None: unbounded
    prefetch: bool = False  # SSMs may draft ahead during verification (engine.prefetch): a neural SSM is deployed


def sampling_params(request: pb.GenerateRequest, config: EngineConfig) -> SamplingParams:
    d = config.defaults
    temperature = request.temperature if request.HasField("temperature") else d.temperature
    top_p = request.top_p if request.HasField("top_p") else d.top_p
    top_k = request.top_k if request.HasField("top_k") else d.top_k
    if not (math.isfinite(temperature) and (temperature == 0.0 or temperature >= MIN_TEMPERATURE)):
        raise InvalidArgument("temperature", f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                              f"got {temperature}")
    if not (math.isfinite(top_p) and MIN_TOP_P <= top_p <= 1.0):
        raise InvalidArgument("top_p", f"must be in [{MIN_TOP_P}, 1], got {top_p}")
    if top_k < 0:
        raise InvalidArgument("top_k", f"must be >= 0 (0 disables top-k), got {top_k}")
    seed = request.seed if request.HasField("seed") else None
    return SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=seed)


def speculation_options(request: pb.GenerateRequest, base: SpeculationOptions,
                        limits: ModelLimits) -> SpeculationOptions:
    """The server's options with the request's overrides; checks names, schedule and mode."""
    if not request.HasField("speculation"):
        return base
    s = request.speculation
    check_enum("speculation.mode", s.mode, MODES)
    check_enum("speculation.children", s.children, CHILDREN)
    expansion = tuple(s.expansion) or base.expansion
    if len(expansion) > MAX_EXPANSION_DEPTH or any(not 1 <= k <= MAX_EXPANSION_WIDTH for k in expansion):
        raise InvalidArgument("speculation.expansion", f"needs 1..{MAX_EXPANSION_DEPTH} widths, each in "
                              f"[1, {MAX_EXPANSION_WIDTH}], got {list(s.expansion)}")
    depth = s.sequence_depth if s.HasField("sequence_depth") else base.sequence_depth
    if not 1 <= depth <= MAX_SEQUENCE_DEPTH:
        raise InvalidArgument("speculation.sequence_depth", f"must be in [1, {MAX_SEQUENCE_DEPTH}], got {depth}")
    unknown = sorted(set(s.ssms) - set(limits.names))
    if unknown:
        raise InvalidArgument("speculation.ssms", f"unknown SSM name(s) {unknown}; known: {list(limits.names)}")
    options = replace(
        base, mode=MODES.get(s.mode, base.mode), expansion=expansion, sequence_depth=depth,
        children=CHILDREN.get(s.children, base.children), proposers=tuple(s.ssms) or base.proposers,
        adaptive=s.adaptive if s.HasField("adaptive") else base.adaptive,
        prefetch=prefetch_count(s, base, limits),
        policy="schedule" if s.expansion else base.policy)  # an explicit schedule is followed as given
    try:
        plan_proposers(limits.names, limits.neural, options)
    except ValueError as error:
        raise InvalidArgument("speculation", str(error)) from None
    return options


def prefetch_count(s: pb.SpeculationOptions, base: SpeculationOptions, limits: ModelLimits) -> int:
    """The request's ``speculation.prefetch`` (unset: the server's), checked against its bound."""
    if not s.HasField("prefetch"):
        return base.prefetch
    if not 0 <= s.prefetch <= MAX_PREFETCH:
        raise InvalidArgument("speculation.prefetch", f"must be in [0, {MAX_PREFETCH}], got {s.prefetch}")
    if s.prefetch and not limits.prefetch:
        raise InvalidArgument("speculation.prefetch", "needs a neural SSM: this server has none")
    return s.prefetch


def check_enum(field: str, value: int, known: dict[int, str]) -> None:
    """Proto3 enums are open: a value the server does not know arrives as a bare number."""
    if value and value not in known:
        raise InvalidArgument(field, f"unknown enum value {value}; known: 0 (server default) or "
                              f"{', '.join(f'{v} ({name})' for v, name in known.items())}")


def check_sizes(request: pb.GenerateRequest, server: ServerConfig) -> None:
    """Prompt and stop-string sizes against the server's limits, before anything is tokenized."""
    chars = len(request.prompt) + sum(len(m.role) + len(m.content) for m in request.messages)
    if chars > server.max_prompt_chars:
        field = "messages" if request.messages and not request.prompt else "prompt"
        raise InvalidArgument(field, f"{chars} characters; at most {server.max_prompt_chars} "
                              "(server.max_prompt_chars)")
    if len(request.stop) > server.max_stop_strings:
        raise InvalidArgument("stop", f"at most {server.max_stop_strings} stop strings (server.max_stop_strings), "
                              f"got {len(request.stop)}")
    for index, stop in enumerate(request.stop):
        if len(stop) > server.max_stop_string_chars:
            raise InvalidArgument(f"stop[{index}]", f"{len(stop)} characters; at most "
                                  f"{server.max_stop_string_chars} (server.max_stop_string_chars)")


def prompt_ids(request: pb.GenerateRequest, tokenizer) -> list[int]:
    """Token ids of the prompt (raw) or of the messages (through the chat template)."""
    if bool(request.prompt) == bool(request.messages):
        which = "both are set" if request.prompt else "neither is set (or the prompt is empty)"
        raise InvalidArgument("prompt", f"exactly one of prompt and messages must be non-empty; {which}")
    if request.prompt:
        ids = tokenizer.encode(request.prompt)
    else:
        ids = _chat_ids(request, tokenizer)
    if not ids:
        raise InvalidArgument("prompt", "encodes to no tokens")
    return list(ids)


def _chat_ids(request: pb.GenerateRequest, tokenizer) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("messages", "the target model has no chat template; send a raw prompt")
    for index, message in enumerate(request.messages):
        if not message.role:
            raise InvalidArgument(f"messages[{index}].role", "must not be empty")
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def max_new_tokens(request: pb.GenerateRequest, config: EngineConfig, prompt_length: int,
                   max_context: int | None) -> int:
    """The request's budget: [1, server limit], and prompt + new tokens within the context.

    An unset value takes the config default, shortened to fit the context.
    """
    room = config.server.max_new_tokens_limit
    if max_context is not None:
        if prompt_length >= max_context:
            raise InvalidArgument("prompt", f"{prompt_length} tokens; the model's context is {max_context} tokens, "
                                  f"so a prompt may have at most {max_context - 1}")
        room = min(room, max_context - prompt_length)
    if not request.HasField("max_new_tokens"):
        return min(config.defaults.max_new_tokens, room)
    if not 1 <= request.max_new_tokens <= room:
        raise InvalidArgument("max_new_tokens", f"must be in [1, {room}] for this prompt of {prompt_length} tokens "
                              f"(server limit {config.server.max_new_tokens_limit}, context {max_context}), "
                              f"got {request.max_new_tokens}")
    return request.max_new_tokens


def parse_request(request: pb.GenerateRequest, config: EngineConfig, base: SpeculationOptions, tokenizer,
                  limits: ModelLimits) -> GenerationRequest:
    """Check every field (raising InvalidArgument) and build the engine's request."""
    sampling = sampling_params(request, config)
    options = speculation_options(request, base, limits)
    check_sizes(request, config.server)
    ids = prompt_ids(request, tokenizer)
    budget = max_new_tokens(request, config, len(ids), limits.max_context)
    return GenerationRequest(tuple(ids), budget, sampling, options, tuple(s for s in request.stop if s))


def stats_message(stats: GenerationStats) -> pb.GenerationStats:
    return pb.GenerationStats(
        mode=stats.mode, target_steps=stats.target_steps, new_tokens=stats.new_tokens,
        tokens_per_step=stats.tokens_per_step, ms_per_token=stats.ms_per_token, draft_ms=stats.draft_ms,
        verify_ms=stats.verify_ms, total_ms=stats.total_ms, draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens, accepted_per_ssm=dict(stats.accepted_per_proposer),
        accepted_per_depth=list(stats.accepted_per_depth), hop_ms=dict(stats.hop_ms),
        tree_sizes=list(stats.tree_sizes), prefetch_hits=stats.prefetch_hits, prefetch_misses=stats.prefetch_misses,
        prefetch_saved_ms=stats.prefetch_saved_ms,
        drafted_through_text={name: counts[0] for name, counts in stats.translated_per_proposer.items()},
        survived_through_text={name: counts[1] for name, counts in stats.translated_per_proposer.items()})


def finish_reason(reason: str | None) -> int:
    return FINISH_REASONS.get(reason or "", pb.FINISH_REASON_UNSPECIFIED)
