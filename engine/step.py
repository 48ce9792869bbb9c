"""One speculative step, written once: draft -> merge -> verify -> commit.

A ``Session`` owns one request's life: the proposer plan (who drafts, with which spec and random
stream, in proposer order), prefill, ``step()``, and emitting tokens and text. Model calls go
through a ``Backend``: ``engine.generate.LocalBackend`` runs them in this process,
``actors.backend.ActorBackend`` sends them to Ray actors. The functions each side runs for a
phase (``draft_with``, ``merge_drafts``, ``verify_and_commit``) are here too, so both transports
execute the same code.

Sync and async: the core is async, since the Serve ingress awaits actor calls. The in-process
engine drives the same coroutines with ``run_sync``/``iterate_sync``: its backend never
suspends, so each coroutine runs to its end in one ``send`` and no event loop is needed.

Random streams: stream 0 is the target's (first token, verification), stream ``i + 1`` proposer
i's, so a seeded request draws the same numbers wherever each part runs. A proposer's generator is
made anew for each draft from (seed, stream, committed length): its draws never depend on how many
drafts ran before, so a draft prefetched during verification equals the one drafted after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, Iterator, Protocol, Sequence

import torch

from .draft import DraftSpec, Draws, Proposal
from .merge import merge
from .programs import Program
from .requests import (HOPS, GenerationRequest, GenerationStats, SpeculationOptions, StepOutcome, StepUpdate)
from .sampling import SamplingParams, make_generator, warp
from .budget import RunningLoad
from .shape import Backoff, ModelFreeLead, TreeCost
from .target import Target, TargetStateLike
from .text import TextStream
from .tree import TokenTree, depths, fit_schedule, schedule_nodes
from .verify import Verdict, verify_greedy, verify_stochastic

CANCELLED = "cancelled"  # finish reason when a model's side dropped the request (released or expired)
TARGET_STREAM = 0


def proposer_stream(proposer: int) -> int:
    """The random stream of proposer ``proposer`` (stream 0 is the target's)."""
    return proposer + 1


# -- The plan: who drafts, how, with which randomness. ---------------------------------------


@dataclass(frozen=True)
class Assignment:
    """One proposer's part in a request: its index in proposer order and its spec (which carries
    the request's sampling, seed included)."""

    proposer: int
    spec: DraftSpec

    def generator(self, position: int) -> torch.Generator:
        """The generator of this proposer's draft at committed length ``position``."""
        return make_generator(self.spec.sampling.seed, proposer_stream(self.proposer), position)


def plan_proposers(names: Sequence[str], neural: Sequence[bool], options: SpeculationOptions,
                   sampling: SamplingParams = SamplingParams(), cost: TreeCost | None = None) -> tuple[Assignment, ...]:
    """The proposers a request uses, in proposer order. Raises ValueError for unknown names.

    ``neural[i]`` tells whether proposer i is a model (sequence mode needs one). Trees are fitted
    to ``options.max_tree_nodes`` (root included) before drawing; each spec's ``max_nodes`` is the
    most nodes its proposer can draw: a model its schedule's full tree, the suffix proposer the budget.
    With ``cost`` and policy "cost" the models' shapes are cost-aware (``engine.shape``), up to the
    budget; a spec applies it only to top-k children of adaptive requests (``DraftSpec.cost_aware``).
    Example: names ("a", "suffix"), neural (True, False), mode "sequence", depth 3 ->
    (Assignment(0, DraftSpec((1, 1, 1), "sampled", max_nodes=4)),).
    """
    unknown = set(options.proposers or ()) - set(names)
    if unknown:
        raise ValueError(f"unknown SSM name(s) {sorted(unknown)}; known: {list(names)}")
    chosen = [i for i, name in enumerate(names) if options.proposers is None or name in options.proposers]
    if options.mode == "incremental" or options.max_tree_nodes <= 1:  # the root alone: nobody drafts
        return ()
    if options.mode == "sequence":
        models = [i for i in chosen if neural[i]]
        if not models:
            raise ValueError("sequence mode needs a neural SSM")
        schedule = fit_schedule((1,) * options.sequence_depth, options.max_tree_nodes)
        return (Assignment(models[0], DraftSpec(schedule, "sampled", sampling, max_nodes=schedule_nodes(schedule))),)
    schedule = fit_schedule(options.expansion, options.max_tree_nodes)
    suffix = DraftSpec(schedule, options.children, sampling, min_confidence=options.min_confidence,
                       max_nodes=options.max_tree_nodes, adaptive=options.adaptive)
    model = replace(suffix, cost=cost if options.policy == "cost" else None)
    # a model draws its schedule's full tree, or up to the budget where its shape follows the cost model
    model = replace(model, max_nodes=options.max_tree_nodes if model.cost_aware else schedule_nodes(schedule))
    return tuple(Assignment(i, model if neural[i] else suffix) for i in chosen)


def tree_reservation(plan: Sequence[Assignment]) -> int:
    """KV entries one step's merged tree can need at most: what admission reserves for it.

    Each proposer's tree has at most ``spec.max_nodes`` nodes (root included) and all share the
    root. Example: two SSMs with schedule (2, 2, 1, 1) (15 nodes) and the suffix proposer with a budget
    of 64 -> 1 + 14 + 14 + 63 = 92; no proposers -> 1 (the root alone).
    """
    return 1 + sum(a.spec.max_nodes - 1 for a in plan)


# -- The phases, as each side runs them. ------------------------------------------------------


@dataclass(frozen=True)
class Prefetched:
    """Prefetch figures of a step's drafts (``engine.prefetch``): proposers whose tree was ready
    when the verdict came (hits), proposers that had drafted ahead for other outcomes (misses),
    and the drafting ms the hits did not wait for."""

    hits: int = 0
    misses: int = 0
    saved_ms: float = 0.0

    def __add__(self, other: "Prefetched") -> "Prefetched":
        return Prefetched(self.hits + other.hits, self.misses + other.misses, self.saved_ms + other.saved_ms)


@dataclass(frozen=True)
class Drafted:
    """A (merged) proposal with the time its drafting and merging took where they ran."""

    proposal: Proposal
    draft_ms: float = 0.0
    merge_ms: float = 0.0
    prefetched: Prefetched = Prefetched()


def root_only_proposal(root: int) -> Proposal:
    """A tree of just the root (incremental decoding: the target proposes its own next token)."""
    empty = torch.zeros(0, dtype=torch.long)
    return Proposal(TokenTree.root_only(root), Draws(empty, empty, None, torch.zeros(0, dtype=torch.bool)))


def draft_with(drafter, state, committed: list[int], spec: DraftSpec, generator: torch.Generator) -> Drafted:
    """One proposer's tree for the committed tokens (root last), timed."""
    began = time.perf_counter()
    proposal = drafter.draft(state, committed, spec, generator)
    return Drafted(proposal, draft_ms=(time.perf_counter() - began) * 1e3)


def merge_drafts(drafts: Sequence[Drafted], root: int, draft_ms: float) -> Drafted:
    """Fold the proposals (given in proposer order) into one tree; the root alone when none.

    ``draft_ms``: the drafting time this step waited for (the slowest of parallel proposers).
    """
    began = time.perf_counter()
    proposal = merge([d.proposal for d in drafts]) if drafts else root_only_proposal(root)
    prefetched = sum((d.prefetched for d in drafts), Prefetched())
    return Drafted(proposal, draft_ms, (time.perf_counter() - began) * 1e3, prefetched)


def first_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:  # logits [V]
    if sampling.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(warp(logits, sampling), 1, generator=generator))


def verify_and_commit(target: Target, state: TargetStateLike, drafted: Drafted, sampling: SamplingParams,
                      generator: torch.Generator) -> StepOutcome:
    """One target forward over the tree, verification, and commit of the accepted path."""
    began, prefix = time.perf_counter(), state.length
    logits = target.forward_tree(state, drafted.proposal.tree)  # [N, V]
    return settle(target, state, prefix, drafted, logits, sampling, generator, began)


def verify_program(target: Target, state: TargetStateLike, drafted: Drafted, sampling: SamplingParams,
                   generator: torch.Generator) -> Program:
    """``verify_and_commit`` as a forward program (``engine.programs``): the tree is one item of the
    target's packed pass (``engine.loop``); returns the StepOutcome."""
    began, prefix = time.perf_counter(), state.length
    logits = yield from target.tree_program(state, drafted.proposal.tree)  # [N, V]
    return settle(target, state, prefix, drafted, logits, sampling, generator, began)


def settle(target: Target, state: TargetStateLike, prefix: int, drafted: Drafted, logits: torch.Tensor,  # [N, V]
           sampling: SamplingParams, generator: torch.Generator, began: float) -> StepOutcome:
    """Verification of the tree against the target's logits, then commit of the accepted path."""
    proposal = drafted.proposal
    if sampling.greedy:
        verdict = verify_greedy(proposal.tree, logits.argmax(dim=-1).cpu())
    else:
        verdict = verify_stochastic(proposal, warp(logits, sampling).cpu(), generator)
    target.commit(state, prefix, verdict.path)
    return step_outcome(drafted, verdict, (time.perf_counter() - began) * 1e3)


def step_outcome(drafted: Drafted, verdict: Verdict, verify_ms: float) -> StepOutcome:
    """What the step committed and who proposed it (a token credits every proposer that drew it)."""
    proposal = drafted.proposal
    accepted = list(verdict.path[1:])
    node_depths, draws = depths(proposal.tree.parents), proposal.draws
    by = tuple(tuple(sorted(set(draws.proposer[draws.node == node].tolist()))) for node in accepted)
    prefetched = drafted.prefetched
    return StepOutcome(tuple(proposal.tree.tokens[accepted].tolist()) + (verdict.next_token,),
                       tuple(int(node_depths[node]) for node in accepted), by, proposal.tree.size - 1,
                       drafted.draft_ms, drafted.merge_ms, verify_ms,
                       prefetched.hits, prefetched.misses, prefetched.saved_ms, proposal.translated)


# -- Where the phases run. --------------------------------------------------------------------


class Backend(Protocol):
    """A request's model calls. ``None`` from prefill or verify: the request was dropped there."""

    async def prefill(self, prompt_ids: list[int]) -> int | None:
        """Create the request's states, run the prompt; the first token (target stream)."""

    async def draft(self, committed: list[int], plan: Sequence[Assignment]) -> object:
        """Every assigned proposer drafts, then the merge; a ``Drafted`` or a handle to one."""

    async def verify(self, drafted: object) -> StepOutcome | None:
        """``verify_and_commit`` on the target side."""

    def release(self) -> None:
        """Drop the request's state everywhere (idempotent)."""


# -- The session. -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """One step's proposers (none: plain decoding) and whether a cost-aware shape is among them."""

    assignments: tuple[Assignment, ...]
    cost_aware: bool = False


class Session:
    """One request: prefill, then draft -> merge -> verify -> commit until it ends.

    ``names``/``neural``: the proposers in proposer order. ``tree_budget()``: the most nodes
    (root included) this request's tree may have this step, None for no cap beyond the request's.
    ``cost``: the cost model of cost-aware shapes (None: every tree follows its schedule).
    ``load``: the running requests of a batched server; then the cost-aware trees plan against the
    others' share of the verify pass (``engine.shape.BatchLoad``) instead of ``tree_budget()``,
    which still bounds the other proposers' trees.
    """

    def __init__(self, backend: Backend | None, request: GenerationRequest, names: Sequence[str], neural: Sequence[bool],
                 tokenizer, eos_ids, tree_budget: Callable[[], int | None] = lambda: None,
                 cost: TreeCost | None = None, load: RunningLoad | None = None):
        self.backend, self.request, self.names, self.neural = backend, request, tuple(names), tuple(neural)
        self.cost, self.load = cost, load
        self.backoff = Backoff()  # plain decoding while cost-aware trees keep choosing no nodes
        self.lead = ModelFreeLead()  # the suffix proposer alone while it carries the steps
        self.model_free = frozenset(i for i, is_model in enumerate(neural) if not is_model)
        if load is not None:
            load.join(self)
        self.eos_ids, self.tree_budget = frozenset(eos_ids), tree_budget
        self.stats = GenerationStats(mode=request.speculation.mode)
        self.committed = list(request.prompt_ids)
        self.text = TextStream(tokenizer, request.stop)
        self.started = time.perf_counter()
        self._plan(request.speculation.max_tree_nodes)

    async def updates(self) -> AsyncIterator[StepUpdate]:
        """One update per target step; the last one has a finish reason. The caller closes."""
        update = await self.prefill()
        yield update
        while update.finish_reason is None:
            update = await self.step()
            yield update

    async def prefill(self) -> StepUpdate:
        first = await self.backend.prefill(self.committed)
        if first is None:
            return self._cancelled()
        return self.start(first)

    async def step(self) -> StepUpdate:
        began = time.perf_counter()
        plan = self.plan_step()
        if plan.assignments:
            drafted = await self.backend.draft(self.committed, plan.assignments)  # draft + merge
        else:
            drafted = Drafted(root_only_proposal(self.committed[-1]))
        outcome = await self.backend.verify(drafted)  # verify + commit
        if outcome is None:
            return self._cancelled()
        return self.finish_step(plan, outcome, (time.perf_counter() - began) * 1e3)

    def start(self, first: int) -> StepUpdate:
        """The prefill's first token (target stream) emitted."""
        self.stats.target_steps = 1
        return self._emit([first])

    def plan_step(self) -> "StepPlan":
        """Who drafts this step, and how: the plan fitted to the tree budget and the load; the
        cost-aware proposers left out while plain decoding pays more (``Backoff``) or the
        model-free proposers carry the steps (``ModelFreeLead``). No assignments: plain decoding."""
        self._fit_to_budget()
        plan = self._under_load()
        cost_aware = any(a.spec.cost_aware for a in plan)
        if cost_aware and (self._led(plan) or not self.backoff.drafts()):
            plan, cost_aware = tuple(a for a in plan if not a.spec.cost_aware), False
        return StepPlan(plan, cost_aware)

    def finish_step(self, plan: "StepPlan", outcome: StepOutcome, wall_ms: float) -> StepUpdate:
        """Count a verified step (``plan_step``'s plan, its outcome, its wall time) and emit its tokens."""
        record_step(self.stats, outcome, self.names, wall_ms)
        if plan.cost_aware:
            self.backoff.record(outcome.draft_tokens)
        self.lead.record(outcome.accepted_by, self.model_free)
        if self.load is not None:
            self.load.record(self, outcome.draft_tokens + 1, len(outcome.tokens))
        return self._emit(list(outcome.tokens))

    def cancelled(self) -> StepUpdate:
        """The last update of a request dropped before it finished."""
        return self._cancelled()

    def close(self) -> None:
        if self.load is not None:
            self.load.leave(self)
        if self.backend is not None:
            self.backend.release()

    def _led(self, plan: Sequence[Assignment]) -> bool:
        """Whether the model-free proposers in ``plan`` carried the last step (``ModelFreeLead``)."""
        return self.lead.carried and any(a.proposer in self.model_free for a in plan)

    def _plan(self, max_tree_nodes: int) -> None:
        """The assignments for trees of at most ``max_tree_nodes`` (kept until that changes)."""
        self.planned_nodes = max_tree_nodes
        options = replace(self.request.speculation, max_tree_nodes=max_tree_nodes)
        self.plan = plan_proposers(self.names, self.neural, options, self.request.sampling, self.cost)

    def _fit_to_budget(self) -> None:
        budget, nodes = self.tree_budget(), self.request.speculation.max_tree_nodes
        nodes = nodes if budget is None else min(budget, nodes)
        if nodes != self.planned_nodes:
            self._plan(nodes)

    def _under_load(self) -> tuple[Assignment, ...]:
        """This step's plan: with a ``load``, each cost-aware spec plans against the other running
        requests' share of the pass, up to the request's own max_tree_nodes (the batch goodput, not
        the equal share, bounds it)."""
        if self.load is None or not any(a.spec.cost_aware for a in self.plan):
            return self.plan
        batch, nodes = self.load.others(self), self.request.speculation.max_tree_nodes
        return tuple(replace(a, spec=replace(a.spec, max_nodes=nodes, cost=replace(a.spec.cost, load=batch)))
                     if a.spec.cost_aware else a for a in self.plan)

    def _emit(self, new: list[int]) -> StepUpdate:
        kept, chunk, reason = advance(self.text, self.stats, new, self.request.max_new_tokens, self.eos_ids)
        self.committed.extend(kept)
        self.stats.total_ms = (time.perf_counter() - self.started) * 1e3
        return StepUpdate(tuple(kept), chunk, reason, self.stats)

    def _cancelled(self) -> StepUpdate:
        self.stats.total_ms = (time.perf_counter() - self.started) * 1e3
        return StepUpdate((), self.text.finish(), CANCELLED, self.stats)


def record_step(stats: GenerationStats, outcome: StepOutcome, names: Sequence[str], wall_ms: float) -> None:
    """Count one verify step: acceptance per depth and per proposer, and the time per hop."""
    stats.target_steps += 1
    stats.draft_tokens += outcome.draft_tokens
    stats.tree_sizes.append(outcome.draft_tokens)
    for depth, proposers in zip(outcome.accepted_depths, outcome.accepted_by):
        stats.accepted_per_depth.extend([0] * (depth - len(stats.accepted_per_depth)))
        stats.accepted_per_depth[depth - 1] += 1
        for proposer in proposers:
            stats.accepted_per_proposer[names[proposer]] = stats.accepted_per_proposer.get(names[proposer], 0) + 1
    inside = {"draft": outcome.draft_ms, "merge": outcome.merge_ms, "verify": outcome.verify_ms}
    inside["transport"] = max(0.0, wall_ms - sum(inside.values()))
    for hop in HOPS:
        stats.hop_ms[hop] += inside[hop]
    stats.draft_ms += wall_ms - outcome.verify_ms
    stats.verify_ms += outcome.verify_ms
    stats.prefetch_hits += outcome.prefetch_hits
    stats.prefetch_misses += outcome.prefetch_misses
    stats.prefetch_saved_ms += outcome.prefetch_saved_ms
    for proposer, drafted, survived in outcome.translated:
        counts = stats.translated_per_proposer.setdefault(names[proposer], [0, 0])
        counts[0] += drafted
        counts[1] += survived


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


# -- The synchronous driver. ------------------------------------------------------------------


def run_sync(coroutine):
    """Run a coroutine that never suspends (an in-process backend's) to its result."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("an in-process backend suspended; drive it with an event loop instead")


def iterate_sync(updates: AsyncIterator) -> Iterator:
    """The items of an async iterator whose awaits never suspend, as a plain iterator."""
    while True:
        try:
            yield run_sync(updates.__anext__())
        except StopAsyncIteration:
            return
