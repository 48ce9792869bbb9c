"""What a request asks for and what it gets back: options, request, per-step update, result, stats.

Plain frozen dataclasses that cross every boundary (in-process engine, Ray actors, the ingress).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import SamplingParams

MODES = ("incremental", "sequence", "tree")
POLICIES = ("cost", "schedule")  # tree shapes: cost-aware (engine.shape) where a cost model exists, or the schedule
MAX_PREFETCH = 8  # outcomes an SSM drafts ahead for, at most
HOPS = ("draft", "merge", "verify", "transport")  # where a step's wall time goes (GenerationStats.hop_ms)


@dataclass(frozen=True)
class SpeculationOptions:
    """How a request speculates. ``proposers`` names the SSMs to use (None: all of them).

    ``max_tree_nodes`` bounds each proposer's tree, root included (see ``engine.tree.fit_schedule``).
    """

    mode: str = "tree"
    expansion: tuple[int, ...] = (2, 2, 1, 1)
    sequence_depth: int = 4
    children: str = "top_k"
    proposers: tuple[str, ...] | None = None
    max_tree_nodes: int = 64
    min_confidence: float = 0.0  # dynamic tree: expand a node only above this SSM path probability
    # The tree's shape may follow measured costs, load and other requests' outputs (the suffix
    # proposer's global store, cost-aware sizes). False: a shape from the request alone, so a seeded
    # sampled request gives the same tokens whatever else the server ran.
    adaptive: bool = True
    policy: str = "cost"
    # Served path: while the target verifies a tree, each SSM drafts the next one for up to this many
    # guessed outcomes (engine.prefetch); 0: off.
    prefetch: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0 <= self.prefetch <= MAX_PREFETCH:
            raise ValueError(f"prefetch must be in [0, {MAX_PREFETCH}], got {self.prefetch}")
        if self.sequence_depth < 1 or self.max_tree_nodes < 1:
            raise ValueError("sequence_depth and max_tree_nodes must be >= 1")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence}")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    speculation: SpeculationOptions = SpeculationOptions()
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepOutcome:
    """What one verify step committed, with what statistics need (no proposal travels back).

    ``tokens``: the accepted path's tokens (root excluded), then the recovered or bonus token.
    ``accepted_depths[i]`` and ``accepted_by[i]`` (proposer indices) describe ``tokens[i]`` for
    every accepted draft token. ``*_ms``: time spent inside each hop, measured where it ran.
    Example: a tree r->a->b where the target accepts a, then wants c: tokens (a, c),
    accepted_depths (1,), accepted_by ((0,),) when proposer 0 drew a.
    """

    tokens: tuple[int, ...]
    accepted_depths: tuple[int, ...]
    accepted_by: tuple[tuple[int, ...], ...]
    draft_tokens: int
    draft_ms: float = 0.0
    merge_ms: float = 0.0
    verify_ms: float = 0.0
    prefetch_hits: int = 0  # proposers whose tree was drafted ahead for this outcome (engine.prefetch)
    prefetch_misses: int = 0  # proposers that had drafted ahead for other outcomes
    prefetch_saved_ms: float = 0.0  # drafting ms the hits did not wait for
    translated: tuple[tuple[int, int, int], ...] = ()  # drafts through text: (proposer, drafted, survived)


@dataclass
class GenerationStats:
    """Per-request figures, comparable across modes (target_steps counts the prefill).

    ``hop_ms``: summed time per hop of the steps (``HOPS``): draft (the slowest proposer, inside
    its process), merge, verify (target forward, verification and commit, inside the verifier),
    transport (the rest of each step's wall time: calls, scheduling, serialisation).
    """

    mode: str
    target_steps: int = 0
    new_tokens: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0
    draft_tokens: int = 0
    accepted_per_proposer: dict[str, int] = field(default_factory=dict)
    accepted_per_depth: list[int] = field(default_factory=list)
    hop_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(HOPS, 0.0))
    tree_sizes: list[int] = field(default_factory=list)  # each step's merged tree: draft tokens (root excluded)
    prefetch_hits: int = 0  # summed over steps and proposers (StepOutcome)
    prefetch_misses: int = 0
    prefetch_saved_ms: float = 0.0
    # drafts through text (engine.cross_vocab): proposer -> [SSM tokens drafted, target tokens that survived]
    translated_per_proposer: dict[str, list[int]] = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.target_steps if self.target_steps else 0.0

    @property
    def ms_per_token(self) -> float:
        return self.total_ms / self.new_tokens if self.new_tokens else 0.0

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_per_depth)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "target_steps": self.target_steps, "new_tokens": self.new_tokens,
            "tokens_per_step": self.tokens_per_step, "ms_per_token": self.ms_per_token,
            "draft_ms": self.draft_ms, "verify_ms": self.verify_ms, "total_ms": self.total_ms,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "accepted_per_proposer": dict(self.accepted_per_proposer),
            "accepted_per_depth": list(self.accepted_per_depth), "hop_ms": dict(self.hop_ms),
            "tree_sizes": list(self.tree_sizes), "prefetch_hits": self.prefetch_hits,
            "prefetch_misses": self.prefetch_misses, "prefetch_saved_ms": self.prefetch_saved_ms,
            "translated_per_proposer": {name: list(counts) for name, counts in self.translated_per_proposer.items()},
        }


@dataclass(frozen=True)
class StepUpdate:
    """What one target step produced, for streaming: new ids, safe new text, and the end."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None  # "stop" | "length" | "cancelled" | None (more to come)
    stats: GenerationStats


@dataclass(frozen=True)
class GenerationResult:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" | "length"
    stats: GenerationStats
