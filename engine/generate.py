"""The speculative generation loop: draft -> merge -> verify -> commit, with statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import torch

from .draft import DraftSpec, Draws, ModelDrafter, NgramDrafter, Proposal
from .merge import fit_schedule, merge
from .sampling import SamplingParams, make_generator, warp
from .target import TargetModel, TargetState
from .text import TextStream
from .tree import TokenTree, depths
from .verify import Verdict, verify_greedy, verify_stochastic

MODES = ("incremental", "sequence", "tree")


@dataclass(frozen=True)
class SpeculationOptions:
    """How a request speculates. ``proposers`` names the SSMs to use (None: all of them)."""

    mode: str = "tree"
    expansion: tuple[int, ...] = (2, 2, 1, 1)
    sequence_depth: int = 4
    children: str = "top_k"
    proposers: tuple[str, ...] | None = None
    max_tree_nodes: int = 64
    min_confidence: float = 0.0  # dynamic tree: expand a node only above this SSM path probability

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
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


@dataclass
class GenerationStats:
    """Per-request figures, comparable across modes (target_steps counts the prefill)."""

    mode: str
    target_steps: int = 0
    new_tokens: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0
    draft_tokens: int = 0
    accepted_per_proposer: dict[str, int] = field(default_factory=dict)
    accepted_per_depth: list[int] = field(default_factory=list)

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
            "accepted_per_depth": list(self.accepted_per_depth),
        }


@dataclass(frozen=True)
class GenerationResult:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" | "length"
    stats: GenerationStats


def credit(stats: GenerationStats, proposal: Proposal, verdict: Verdict, names: Sequence[str]) -> None:
    """Count accepted tokens per depth and per proposer (a token credits every proposer of it)."""
    node_depths = depths(proposal.tree.parents).tolist()
    for node in verdict.path[1:]:
        depth = node_depths[node]
        stats.accepted_per_depth.extend([0] * (depth - len(stats.accepted_per_depth)))
        stats.accepted_per_depth[depth - 1] += 1
        for proposer in set(proposal.draws.proposer[proposal.draws.node == node].tolist()):
            stats.accepted_per_proposer[names[proposer]] = stats.accepted_per_proposer.get(names[proposer], 0) + 1


def verify_tree(
    target: TargetModel, state: TargetState, proposal: Proposal, sampling: SamplingParams, generator: torch.Generator
) -> Verdict:
    """Verify and commit in one call: one target forward over the tree, then keep the path."""
    prefix = state.length
    logits = target.forward_tree(state, proposal.tree)  # [N, V]
    if sampling.greedy:
        verdict = verify_greedy(proposal.tree, logits.argmax(dim=-1).cpu())
    else:
        verdict = verify_stochastic(proposal, warp(logits, sampling).cpu(), generator)
    target.commit(state, prefix, verdict.path)
    return verdict


def first_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:  # logits [V]
    if sampling.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(warp(logits, sampling), 1, generator=generator))


@dataclass(frozen=True)
class StepUpdate:
    """What one target step produced, for streaming: new ids, safe new text, and the end."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    stats: GenerationStats


def take_new_tokens(new: Sequence[int], generated: int, max_new_tokens: int, eos_ids) -> tuple[list[int], str | None]:
    """Cut a step's tokens at EOS (kept) or at max_new_tokens; return (tokens, finish reason).

    Example: new [4, 2, 9], generated 5, max 10, eos {2} -> ([4, 2], "stop").
    """
    kept: list[int] = []
    for token in new:
        if generated + len(kept) >= max_new_tokens:
            return kept, "length"
        kept.append(token)
        if token in eos_ids:
            return kept, "stop"
    return kept, ("length" if generated + len(kept) >= max_new_tokens else None)


def plan_proposers(names: Sequence[str], neural: Sequence[bool],
                   options: SpeculationOptions) -> list[tuple[int, DraftSpec]]:
    """The proposers a request uses, as (index into ``names``, draft spec); sampling is added later.

    ``neural[i]`` tells whether proposer i is a model (sequence mode needs one). Raises
    ValueError for unknown names. Example: names ("a", "ngram"), neural (True, False),
    mode "sequence", depth 3 -> [(0, DraftSpec((1, 1, 1), "sampled"))].
    """
    unknown = set(options.proposers or ()) - set(names)
    if unknown:
        raise ValueError(f"unknown SSM name(s) {sorted(unknown)}; known: {list(names)}")
    chosen = [i for i, name in enumerate(names) if options.proposers is None or name in options.proposers]
    if options.mode == "incremental":
        return []
    if options.mode == "sequence":
        models = [i for i in chosen if neural[i]]
        if not models:
            raise ValueError("sequence mode needs a neural SSM")
        return [(models[0], DraftSpec((1,) * options.sequence_depth, "sampled"))]
    schedule = fit_schedule(options.expansion, options.max_tree_nodes)
    return [(i, DraftSpec(schedule, options.children, min_confidence=options.min_confidence,
                          max_nodes=options.max_tree_nodes)) for i in chosen]


def step_tokens(proposal: Proposal, verdict: Verdict) -> list[int]:
    """The tokens one verify step commits: the accepted path (root excluded), then next_token."""
    return proposal.tree.tokens[list(verdict.path[1:])].tolist() + [verdict.next_token]


def record_step(stats: GenerationStats, proposal: Proposal, verdict: Verdict, names: Sequence[str],
                draft_ms: float, verify_ms: float) -> list[int]:
    """Count one verify step in ``stats``; return the tokens it commits (before EOS/length cuts)."""
    stats.draft_ms += draft_ms
    stats.verify_ms += verify_ms
    stats.target_steps += 1
    stats.draft_tokens += proposal.tree.size - 1
    credit(stats, proposal, verdict, names)
    return step_tokens(proposal, verdict)


def advance(text: TextStream, stats: GenerationStats, new: Sequence[int], max_new_tokens: int,
            eos_ids) -> tuple[list[int], str, str | None]:
    """Apply one step's tokens: cut at EOS / max_new_tokens, count them, detokenize.

    Returns (kept tokens, text safe to show now, finish reason or None). A stop string ends
    the request with "stop"; at the end the held-back text is flushed.
    """
    kept, reason = take_new_tokens(new, stats.new_tokens, max_new_tokens, eos_ids)
    stats.new_tokens += len(kept)
    chunk = text.push(kept)
    if text.stopped:
        reason = "stop"
    if reason is not None:
        chunk += text.finish()
    return kept, chunk, reason


def root_only_proposal(root: int) -> Proposal:
    """A tree of just the root (incremental decoding: the target proposes its own next token)."""
    empty = torch.zeros(0, dtype=torch.long)
    return Proposal(TokenTree.root_only(root), Draws(empty, empty, None, torch.zeros(0, dtype=torch.bool)))


class SpeculativeEngine:
    """In-process engine: one target and any number of proposers (SSMs and n-gram)."""

    def __init__(self, target: TargetModel, drafters: Sequence[ModelDrafter | NgramDrafter], tokenizer, eos_ids,
                 max_context: int | None = None):
        self.target, self.drafters, self.tokenizer = target, list(drafters), tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.names = [d.name for d in self.drafters]
        self.max_context = max_context or getattr(target.model.config, "max_position_embeddings", None)

    def select(self, options: SpeculationOptions) -> list[tuple[ModelDrafter | NgramDrafter, DraftSpec | None]]:
        """The proposers a request uses, each with its draft spec (sampling added later)."""
        neural = [isinstance(d, ModelDrafter) for d in self.drafters]
        return [(self.drafters[i], spec) for i, spec in plan_proposers(self.names, neural, options)]

    def check_request(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise ValueError("prompt is empty")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if self.max_context and len(request.prompt_ids) + request.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the model's context of {self.max_context} tokens"
            )

    def generate(self, request: GenerationRequest) -> GenerationResult:
        token_ids, text, update = [], [], None
        for update in self.stream(request):
            token_ids.extend(update.token_ids)
            text.append(update.text)
        return GenerationResult(tuple(token_ids), "".join(text), update.finish_reason, update.stats)

    def stream(self, request: GenerationRequest) -> Iterator[StepUpdate]:
        """Yield one StepUpdate per target step; the last one carries the finish reason."""
        self.check_request(request)
        session = _Session(self, request)
        try:
            yield session.prefill()
            while session.finish_reason is None:
                yield session.step()
        finally:  # also when the caller stops early (a cancel): paged KV blocks go back
            session.close()


class _Session:
    """One request's state in the in-process engine."""

    def __init__(self, engine: SpeculativeEngine, request: GenerationRequest):
        self.engine, self.request = engine, request
        self.started = time.perf_counter()
        self.stats = GenerationStats(mode=request.speculation.mode)
        self.proposers = [
            (drafter, drafter.new_state(), replace(spec, sampling=request.sampling),
             make_generator(request.sampling.seed, engine.drafters.index(drafter) + 1))
            for drafter, spec in engine.select(request.speculation)
        ]
        self.target_state = engine.target.new_state()
        self.generator = make_generator(request.sampling.seed, 0)
        self.committed = list(request.prompt_ids)
        self.text = TextStream(engine.tokenizer, request.stop)
        self.finish_reason: str | None = None

    def close(self) -> None:
        """Give the target's and every proposer's state back (paged KV blocks return to their pool)."""
        self.engine.target.release(self.target_state)
        for drafter, state, _, _ in self.proposers:
            drafter.release(state)

    def prefill(self) -> StepUpdate:
        logits = self.engine.target.prefill(self.target_state, self.committed)
        self.stats.target_steps = 1
        return self._emit([first_token(logits, self.request.sampling, self.generator)])

    def step(self) -> StepUpdate:
        began = time.perf_counter()
        proposals = [d.draft(state, self.committed, spec, gen) for d, state, spec, gen in self.proposers]
        proposal = merge(proposals) if proposals else root_only_proposal(self.committed[-1])
        drafted = time.perf_counter()
        verdict = verify_tree(self.engine.target, self.target_state, proposal, self.request.sampling, self.generator)
        tokens = record_step(self.stats, proposal, verdict, self.engine.names, (drafted - began) * 1e3,
                             (time.perf_counter() - drafted) * 1e3)
        return self._emit(tokens)

    def _emit(self, new: list[int]) -> StepUpdate:
        kept, chunk, reason = advance(self.text, self.stats, new, self.request.max_new_tokens, self.engine.eos_ids)
        self.committed.extend(kept)
        self.finish_reason = reason
        self.stats.total_ms = (time.perf_counter() - self.started) * 1e3
        return StepUpdate(tuple(kept), chunk, reason, self.stats)
