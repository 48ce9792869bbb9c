"""The SSM proposer: drafting by top-k expansion (a tree level per forward). The model-free suffix
proposer (``actors.suffix``) builds its proposals with ``TreeBuilder`` too."""

from __future__ import annotations

import bisect
import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from . import kv
from .masks import forward_masks
from .programs import Program, alone, run_alone
from .sampling import SamplingParams, warp
from .shape import ShapeHistory, TreeCost, best_size, frontier_to_expand
from .timing import moving_average
from .tree import TokenTree, ancestor_mask, depths

if TYPE_CHECKING:
    from transformers import DynamicCache

CHILDREN_RULES = ("top_k", "sampled", "sampled_without_replacement")


@dataclass(frozen=True)
class Draws:
    """Every proposed child edge. Several draws may name the same node (kept for exactness).

    node:          # [M] int64, the drawn child's node index (>= 1)
    proposer:      # [M] int64, who drew it
    q:             # [M, V] float32, the exact distribution each draw came from, or None
    deterministic: # [M] bool, True for top-k / suffix-proposer children (a point mass on the token)
    """

    node: torch.Tensor  # [M]
    proposer: torch.Tensor  # [M]
    q: torch.Tensor | None  # [M, V]
    deterministic: torch.Tensor  # [M]


@dataclass(frozen=True)
class Proposal:
    """A proposer's (or a merged) tree and draws. ``translated``: per draft through text
    (``engine.cross_vocab``), (proposer, SSM tokens drafted, target tokens proposed)."""

    tree: TokenTree
    draws: Draws
    translated: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class DraftSpec:
    """What to draft this step: an expansion schedule <k1, ..., km> and how children are drawn."""

    schedule: tuple[int, ...]
    children: str = "top_k"
    sampling: SamplingParams = SamplingParams()
    min_confidence: float = 0.0  # expand a node only if the SSM's path probability reaches this
    max_nodes: int | None = None  # the most nodes this proposer may draw, root included (the suffix proposer's budget)
    adaptive: bool = True  # the shape may use other requests' history and measured costs (SpeculationOptions)
    cost: TreeCost | None = None  # a cost-aware shape (engine.shape) instead of the schedule, for top-k children

    def __post_init__(self) -> None:
        if self.children not in CHILDREN_RULES:
            raise ValueError(f"children must be one of {CHILDREN_RULES}, got {self.children!r}")
        if any(k < 1 for k in self.schedule):
            raise ValueError(f"every expansion width must be >= 1, got {list(self.schedule)}")

    @property
    def rule(self) -> str:
        """Greedy requests always take deterministic top-k children."""
        return "top_k" if self.sampling.greedy else self.children

    @property
    def cost_aware(self) -> bool:
        """Whether the shape follows the cost model: only for deterministic children (re-ranking
        drawn children would bias sampled output) and adaptive requests."""
        return self.cost is not None and self.adaptive and self.rule == "top_k"


@dataclass(frozen=True)
class DraftedLevels:
    """The SSM's KV entries of the nodes a draft expanded (fed in a level forward), put aside when the
    draft ends, so that the next draft feeds only the committed tokens the last one did not.

    An expanded node's entry is the one feeding its token after the committed ones would make: the
    level forward gave it its ancestors' entries, itself, and position ``len(prefix) - 1 + depth``.

    prefix:   the committed tokens it was drafted after (the root last)
    children: (parent node, token) -> node, every node drafted (root 0)
    rows:     expanded node -> its row in ``entries`` (level order)
    entries:  per layer (keys, values), each [B, H, K, D] (``ModelDrafter.save_entries``)
    """

    prefix: tuple[int, ...]
    children: dict[tuple[int, int], int]
    rows: dict[int, int]
    entries: object

    def rows_for(self, committed: list[int]) -> list[int]:
        """The rows of the committed tokens past ``prefix``, in order, up to the first one the draft did
        not expand; never the last committed token (the next root, which is fed for its logits).

        Example: prefix (5, 7), tree 7 -> a(1) -> b(2), 7 -> c(3), expanded 1 then 2 (rows 0, 1):
        committed (5, 7, a, b, x) -> [0, 1]; (5, 7, a, x) -> [0]; (5, 7, c, x) -> [] (3 was a leaf);
        (5, 9, a, x) -> [] (another prefix).
        """
        start = len(self.prefix)
        if len(committed) <= start or tuple(committed[:start]) != self.prefix:
            return []
        node, rows = 0, []
        for token in committed[start:-1]:
            node = self.children.get((node, token), -1)
            if node not in self.rows:
                break
            rows.append(self.rows[node])
        return rows


@dataclass
class TreeBuilder:
    """Accumulates a proposal; identical (parent, token) children share one node."""

    root: int
    proposer: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    draw_nodes: list[int] = field(default_factory=list)
    draw_q: list[torch.Tensor | None] = field(default_factory=list)
    index: dict[tuple[int, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens.append(self.root)
        self.parents.append(-1)

    def add(self, parent: int, token: int, q: torch.Tensor | None) -> int:
        """Record a draw of ``token`` under ``parent``; return the node (new or existing)."""
        node = self.index.get((parent, token))
        if node is None:
            node = self.index[(parent, token)] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
        self.draw_nodes.append(node)
        self.draw_q.append(q)
        return node

    def build(self) -> Proposal:
        tree = TokenTree(torch.tensor(self.tokens, dtype=torch.long), torch.tensor(self.parents, dtype=torch.long))
        deterministic = torch.tensor([q is None for q in self.draw_q], dtype=torch.bool)
        q = None
        if self.draw_q and not bool(deterministic.all()):
            width = next(x for x in self.draw_q if x is not None).shape[-1]
            q = torch.stack([x if x is not None else torch.zeros(width) for x in self.draw_q])
        draws = Draws(
            node=torch.tensor(self.draw_nodes, dtype=torch.long),
            proposer=torch.full((len(self.draw_nodes),), self.proposer, dtype=torch.long),
            q=q,
            deterministic=deterministic,
        )
        return Proposal(tree, draws)


def choose_children(
    logits: torch.Tensor,  # [V]
    width: int,
    spec: DraftSpec,
    generator: torch.Generator,
) -> list[tuple[int, torch.Tensor | None]]:
    """Draws at one node: (token, q it was drawn from, or None for a deterministic child).

    top_k: the ``width`` most likely tokens. sampled: ``width`` i.i.d. draws from q.
    sampled_without_replacement: sequential draws, each from q with the earlier draws zeroed
    and renormalised (the exact conditional distribution is stored with each draw).
    """
    rule = spec.rule
    if rule == "top_k":
        return [(int(t), None) for t in torch.topk(logits, width).indices]
    q = warp(logits.cpu(), spec.sampling)  # a drafter may leave its logits on its device; draws use a CPU generator
    if rule == "sampled":
        drawn = torch.multinomial(q, width, replacement=True, generator=generator)
        return [(int(t), q) for t in drawn]
    result = []
    for _ in range(min(width, int((q > 0).sum()))):
        token = int(torch.multinomial(q, 1, generator=generator))
        result.append((token, q))
        q = q.clone()
        q[token] = 0.0
        q = q / q.sum()
    return result


def level_visibility(builder: TreeBuilder, level: list[int], cached: list[int]) -> torch.Tensor:  # -> [F, K]
    """What each node of a level forward sees among the draft's own entries ``cached + level``
    (K columns, in that order): its ancestors and itself.

    Example: parents [-1, 0, 0, 1], cached [1, 2], level [3] -> [[1, 0, 1]] (node 3 sees 1 and itself).
    """
    return ancestor_mask(torch.tensor(builder.parents, dtype=torch.long))[level][:, cached + level]


def level_positions(builder: TreeBuilder, nodes: list[int], committed_length: int) -> torch.Tensor:  # -> [len(nodes)]
    """Positions of a draft's tree nodes: the root (the last committed token) at committed_length - 1,
    each node at the root's plus its depth.

    Example: parents [-1, 0, 0, 1], nodes [1, 3], committed_length 5 -> [5, 6].
    """
    return depths(torch.tensor(builder.parents, dtype=torch.long))[nodes] + committed_length - 1


def _set_or_drop(table: dict, state, value) -> None:
    """``table[state] = value``, or drop the state's entry when ``value`` is None."""
    if value is None:
        table.pop(state, None)
    else:
        table[state] = value


class ModelDrafter:
    """A neural SSM drafting a whole tree level per forward with the tree attention mask."""

    neural = True  # a model (``engine.step.plan_proposers``); the suffix proposer's is False

    own_stream = True  # on CUDA, drafting may run on a stream of its own (on_own_stream)
    clock = staticmethod(time.perf_counter)  # seconds; cost-aware shapes time the draft and its forwards with it
    keeps_levels = True  # a draft puts its expanded nodes' entries aside for the next (DraftedLevels)
    context_tokens: int | None = None  # on the engine loop: the most committed tokens its first draft takes in

    def __init__(self, model, proposer: int, name: str):
        self.model = model
        self.proposer = proposer
        self.name = name
        self.forward_ms: dict[int, float] = {}  # tokens in a forward -> its ms (moving average), for cost-aware shapes
        self._shapes: dict[object, ShapeHistory] = {}  # state (hashed by identity) -> its shape history
        self._levels: dict[object, DraftedLevels] = {}  # state -> the last draft's expanded nodes' entries
        self._stream = None  # its CUDA stream (on_own_stream), made on first use

    @functools.cached_property
    def dtype(self) -> torch.dtype:
        """Its masks' dtype, read once (``kv.activation_dtype`` walks every parameter)."""
        return kv.activation_dtype(self.model)

    def on_own_stream(self) -> contextlib.AbstractContextManager:
        """On CUDA: run the drafter's work on a stream of its own (made once), so that it overlaps the
        target's passes on the default stream (in-process prefetch); elsewhere, or where the drafter's
        forwards may run on other threads (``own_stream`` False), a no-op. Everything a draft returns
        is on the CPU, so nothing crosses streams."""
        if self.model.device.type != "cuda" or not self.own_stream:
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.model.device)
        return torch.cuda.stream(self._stream)

    def new_state(self) -> DynamicCache:
        return kv.new_cache()

    def release(self, state: DynamicCache) -> None:
        """Forget the request's shape history and drafted levels; a DynamicCache is freed with its state."""
        self._shapes.pop(state, None)
        self._levels.pop(state, None)

    def shape_history(self, state) -> ShapeHistory:
        """The request's calibration and last proposal (made on first use, dropped by ``release``)."""
        history = self._shapes.get(state)
        if history is None:
            history = self._shapes[state] = ShapeHistory()
        return history

    def shape_of(self, state) -> ShapeHistory | None:
        """The request's shape history, None before its first cost-aware draft (made by none)."""
        return self._shapes.get(state)

    def set_shape(self, state, history: ShapeHistory | None) -> None:
        """Put back a shape history from ``shape_of`` (prefetch drafts ahead, then restores it)."""
        _set_or_drop(self._shapes, state, history)

    def levels_of(self, state) -> DraftedLevels | None:
        """The entries the last draft put aside (``DraftedLevels``), None if none."""
        return self._levels.get(state)

    def set_levels(self, state, levels: DraftedLevels | None) -> None:
        """Put back drafted levels from ``levels_of`` (prefetch drafts each guess from the same ones)."""
        _set_or_drop(self._levels, state, levels)

    # -- What prefetch (engine.prefetch) does to a state besides drafting. ----------------------

    @torch.inference_mode()
    def forward_tokens(self, cache: DynamicCache, tokens: list[int]) -> torch.Tensor:  # -> [G, V]
        """The SSM's logits after each of ``tokens`` fed after the cached ones; the cache is left as it was."""
        length = kv.cache_length(cache)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.model.device)
        out = self.model(input_ids=ids, **kv.cache_argument(self.model, cache), use_cache=True)
        kv.crop(cache, length)
        return out.logits[0].float().cpu()

    def save_entries(self, cache: DynamicCache, start: int) -> object:
        """A copy of the cached entries from ``start`` on (for ``restore_entries``)."""
        return kv.tail(cache, start)

    def restore_entries(self, cache: DynamicCache, start: int, saved: object) -> None:
        """Keep the first ``start`` entries, then the saved ones, value for value."""
        kv.restore_tail(cache, start, saved)

    def drop_entries(self, cache: DynamicCache, saved: object) -> None:
        """Saved entries that will not be restored (a copy in memory: nothing to give back)."""

    def rollback(self, cache: DynamicCache, length: int) -> None:
        """Drop the drafted levels: keep the ``length`` committed tokens."""
        kv.crop(cache, length)

    @torch.inference_mode()
    def draft(
        self, cache: DynamicCache, committed: list[int], spec: DraftSpec, generator: torch.Generator
    ) -> Proposal:
        """Extend the cache with the committed tokens it lacks, then expand level by level.

        ``committed`` ends with the root (the last committed token). On return the cache holds
        exactly the committed tokens: the drafted levels are cropped away, and their entries put
        aside (``DraftedLevels``) for the next draft, which feeds only the tokens they lack.
        """
        return run_alone(self.draft_program(cache, committed, spec, generator))

    @torch.inference_mode()
    def draft_program(self, cache, committed: list[int], spec: DraftSpec, generator: torch.Generator) -> Program:
        """``draft`` as a forward program (``engine.programs``) returning the Proposal: it yields one
        forward for the committed tokens the cache lacks, then one per tree level, so that a loop can
        run every request's level in one packed forward (``engine.loop``)."""
        if spec.cost_aware:
            return (yield from self._draft_by_cost(cache, committed, spec))
        logits = (yield from self._extend_program(cache, committed))[0][None]  # [F, V], F = 1 at the root
        builder = TreeBuilder(root=committed[-1], proposer=self.proposer)
        frontier, cached, confidence = [0], [], {0: 1.0}
        for depth, width in enumerate(spec.schedule, start=1):
            first = len(builder.tokens)
            for row, parent in zip(logits, frontier):
                probabilities = torch.softmax(row, dim=-1)  # [V]
                for token, q in choose_children(row, width, spec, generator):
                    node = builder.add(parent, token, q)
                    confidence[node] = confidence[parent] * float(probabilities[token])
            # Dynamic tree: only confident nodes are expanded, decided before their children are drawn.
            frontier = [n for n in range(first, len(builder.tokens)) if confidence[n] >= spec.min_confidence]
            if depth == len(spec.schedule) or not frontier:
                break
            logits = yield from self._level_program(cache, builder, frontier, cached, depth, len(committed))
            cached += frontier
        self._put_levels_aside(cache, committed, builder, cached)
        return builder.build()

    def _draft_by_cost(self, cache, committed: list[int], spec: DraftSpec) -> Program:
        """Cost-aware growth (``engine.shape``): each level, as many of the ``beam`` most probable
        nodes as are expected to pay get their ``branch`` most likely children, while one more level
        is expected to pay; the nodes that maximise expected tokens per ms are kept."""
        began, cost, limit = self.clock(), spec.cost, (spec.max_nodes or 1 << 30) - 1
        history = self.shape_history(cache)
        stepping = history.last is not None  # not the request's first draft, which feeds its whole prompt
        history.observe(committed)
        root_logits, fed = yield from self._extend_program(cache, committed)
        logits = root_logits[None]  # [F, V], F = 1 at the root
        if stepping:  # the accepted tokens: a forward of a few tokens, like a level's, keeps the estimate fresh
            self._time_forward(began, fed)
        builder, path = TreeBuilder(root=committed[-1], proposer=self.proposer), [1.0]
        frontier, cached = [0], []
        for depth in range(1, cost.max_depth + 1):
            first = len(builder.tokens)
            ratio = self._expand(builder, path, logits, frontier, cost.branch)
            frontier = sorted(range(first, len(builder.tokens)), key=lambda n: -path[n])[:cost.beam]
            elapsed = (self.clock() - began) * 1e3
            count = 0 if depth == cost.max_depth else frontier_to_expand(
                sorted(path[1:], reverse=True), [path[n] for n in frontier], ratio, history.calibration,
                elapsed, self.level_costs(len(frontier)), cost, limit, history.overlap)
            if not count:
                break
            frontier = frontier[:count]
            level_began = self.clock()
            logits = yield from self._level_program(cache, builder, frontier, cached, depth, len(committed))
            self._time_forward(level_began, count)
            cached += frontier
        self._put_levels_aside(cache, committed, builder, cached)
        return self._keep_best(builder, path, history, len(committed), (self.clock() - began) * 1e3,
                               cost, limit)

    def level_costs(self, most: int) -> list[float]:
        """Expected ms of a level forward over 1..``most`` nodes: each size's own moving average,
        linear between measured sizes, the nearest end's beyond them (0 before any forward was timed).
        Example: measured {1: 25, 4: 34} -> level_costs(5) [25, 28, 31, 34, 34]."""
        sizes = sorted(self.forward_ms)
        if not sizes:
            return [0.0] * most
        costs = []
        for f in range(1, most + 1):
            i = bisect.bisect_left(sizes, f)
            if i == 0 or i == len(sizes):
                costs.append(self.forward_ms[sizes[min(i, len(sizes) - 1)]])
                continue
            (s0, m0), (s1, m1) = (sizes[i - 1], self.forward_ms[sizes[i - 1]]), (sizes[i], self.forward_ms[sizes[i]])
            costs.append(m0 + (m1 - m0) * (f - s0) / (s1 - s0))
        return costs

    def _time_forward(self, began: float, tokens: int) -> None:
        """Fold one SSM forward's ms over ``tokens`` tokens into ``forward_ms`` (a moving average)."""
        ms = (self.clock() - began) * 1e3
        self.forward_ms[tokens] = moving_average(self.forward_ms.get(tokens), ms)

    def _expand(self, builder: TreeBuilder, path: list[float], logits: torch.Tensor,  # logits [F, V]
                frontier: list[int], branch: int) -> float:
        """Add each frontier node's ``branch`` most likely children (deterministic draws), with their
        path probabilities; return the mean probability of the top children."""
        tops = []
        for row, parent in zip(logits, frontier):
            top = torch.topk(torch.softmax(row, dim=-1), branch)
            tops.append(float(top.values[0]))
            for p, token in zip(top.values.tolist(), top.indices.tolist()):
                if builder.add(parent, token, None) == len(path):
                    path.append(path[parent] * p)
        return sum(tops) / len(tops)

    def _keep_best(self, builder: TreeBuilder, path: list[float], history: ShapeHistory, length: int,
                   draft_ms: float, cost: TreeCost, limit: int) -> Proposal:
        """The best-rate prefix of the nodes ranked by path probability (ties: lower index first, so
        a parent precedes its children and the kept nodes form a tree), in topological order."""
        ranked = sorted(range(1, len(builder.tokens)), key=lambda n: (-path[n], n))
        count, _ = best_size([path[n] for n in ranked], history.calibration, draft_ms, cost, limit,
                             history.overlap)
        kept = sorted(ranked[:count])
        pruned, index = TreeBuilder(root=builder.root, proposer=self.proposer), {0: 0}
        for node in kept:
            index[node] = pruned.add(index[builder.parents[node]], builder.tokens[node], None)
        history.last = (length, list(pruned.tokens), list(pruned.parents), [1.0] + [path[n] for n in kept])
        return pruned.build()

    def _put_levels_aside(self, cache, committed: list[int], builder: TreeBuilder, cached: list[int]) -> None:
        """End a draft: keep the expanded nodes' entries aside (``DraftedLevels``; none when nothing
        was expanded or the drafter keeps none), then crop the cache to the committed tokens."""
        levels = None
        if cached and self.keeps_levels:
            levels = DraftedLevels(tuple(committed), builder.index, {node: row for row, node in enumerate(cached)},
                                   self.save_entries(cache, len(committed)))
        self.set_levels(cache, levels)
        self.rollback(cache, len(committed))

    def _resume(self, cache: DynamicCache, committed: list[int]) -> int:
        """Bring the cache to as many committed tokens as it can hold without a forward: those it
        holds, then the accepted ones the last draft expanded (``DraftedLevels.rows_for``), never the
        root. Returns that count; the drafted levels are used once."""
        length, levels = kv.cache_length(cache), self._levels.pop(cache, None)
        if levels is not None and length == len(levels.prefix):
            rows = levels.rows_for(committed)
            if rows:
                kv.append_rows(cache, levels.entries, rows)
                length += len(rows)
        start = min(length, len(committed) - 1)
        kv.crop(cache, start)
        return start

    def _extend_program(self, cache, committed: list[int]) -> Program:  # -> ([V], fed)
        """``_extend`` as a program: one forward, run by itself (a packed drafter yields its item)."""
        return (yield alone(lambda: self._extend(cache, committed)))

    def _level_program(self, cache, builder: TreeBuilder, level: list[int], cached: list[int], depth: int,
                       committed_length: int) -> Program:  # -> [F, V]
        """``_forward_level`` as a program: one forward, run by itself (a packed drafter yields its item)."""
        return (yield alone(lambda: self._forward_level(cache, builder, level, cached, depth, committed_length)))

    def _extend(self, cache: DynamicCache, committed: list[int]) -> tuple[torch.Tensor, int]:  # -> [V], fed
        """Feed the committed tokens the cache lacks (at least the root): the logits after the root,
        and how many tokens were fed."""
        start = self._resume(cache, committed)
        ids = torch.tensor([committed[start:]], dtype=torch.long, device=self.model.device)
        out = self.model(input_ids=ids, **kv.cache_argument(self.model, cache), use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().cpu(), len(committed) - start

    def _forward_level(
        self, cache: DynamicCache, builder: TreeBuilder, level: list[int], cached: list[int], depth: int,
        committed_length: int,
    ) -> torch.Tensor:  # -> [F, V]
        """One SSM forward over the nodes of a level that will be expanded.

        The cache holds the committed tokens, then the ``cached`` nodes in that order; the level's
        nodes are appended, so the keys are [committed | cached | level].
        """
        visible = level_visibility(builder, level, cached)  # [F, K]
        device = self.model.device
        ids = torch.tensor([[builder.tokens[n] for n in level]], dtype=torch.long, device=device)
        position_ids = torch.full_like(ids, committed_length - 1 + depth)
        keys = level_positions(builder, cached + level, committed_length)  # [K]
        masks = forward_masks(self.model.config, visible, committed_length, position_ids[0].cpu(), keys, self.dtype,
                              device)
        out = self.model(input_ids=ids, attention_mask=masks, position_ids=position_ids,
                         **kv.cache_argument(self.model, cache), use_cache=True)
        return out.logits[0].float().cpu()

