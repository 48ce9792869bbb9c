"""Proposers: SSM drafting by top-k expansion (a tree level per forward) and prompt lookup."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from . import kv
from .sampling import SamplingParams, warp
from .tree import TokenTree, ancestor_mask, attention_bias

CHILDREN_RULES = ("top_k", "sampled", "sampled_without_replacement")


@dataclass(frozen=True)
class Draws:
    """Every proposed child edge. Several draws may name the same node (kept for exactness).

    node:          # [M] int64, the drawn child's node index (>= 1)
    proposer:      # [M] int64, who drew it
    q:             # [M, V] float32, the exact distribution each draw came from, or None
    deterministic: # [M] bool, True for top-k / n-gram children (a point mass on the token)
    """

    node: torch.Tensor  # [M]
    proposer: torch.Tensor  # [M]
    q: torch.Tensor | None  # [M, V]
    deterministic: torch.Tensor  # [M]


@dataclass(frozen=True)
class Proposal:
    tree: TokenTree
    draws: Draws


@dataclass(frozen=True)
class DraftSpec:
    """What to draft this step: an expansion schedule <k1, ..., km> and how children are drawn."""

    schedule: tuple[int, ...]
    children: str = "top_k"
    sampling: SamplingParams = SamplingParams()
    min_confidence: float = 0.0  # expand a node only if the SSM's path probability reaches this
    max_nodes: int | None = None  # the most nodes this proposer may draw, root included (the n-gram's budget)

    def __post_init__(self) -> None:
        if self.children not in CHILDREN_RULES:
            raise ValueError(f"children must be one of {CHILDREN_RULES}, got {self.children!r}")
        if any(k < 1 for k in self.schedule):
            raise ValueError(f"every expansion width must be >= 1, got {list(self.schedule)}")

    @property
    def rule(self) -> str:
        """Greedy requests always take deterministic top-k children."""
        return "top_k" if self.sampling.greedy else self.children


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
    q = warp(logits, spec.sampling)
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


class ModelDrafter:
    """A neural SSM drafting a whole tree level per forward with the tree attention mask."""

    def __init__(self, model, proposer: int, name: str):
        self.model = model
        self.proposer = proposer
        self.name = name

    def new_state(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def release(self, state: DynamicCache) -> None:
        """Nothing to give back: a DynamicCache is freed with its state (PagedDrafter overrides)."""

    @torch.inference_mode()
    def draft(
        self, cache: DynamicCache, committed: list[int], spec: DraftSpec, generator: torch.Generator
    ) -> Proposal:
        """Extend the cache with the committed tokens it lacks, then expand level by level.

        ``committed`` ends with the root (the last committed token). On return the cache holds
        exactly the committed tokens: the drafted levels are cropped away.
        """
        logits = self._extend(cache, committed)[None]  # [F, V], F = 1 at the root
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
            logits = self._forward_level(cache, builder, frontier, cached, depth, len(committed))
            cached += frontier
        self._rollback(cache, len(committed))
        return builder.build()

    def _rollback(self, cache: DynamicCache, length: int) -> None:
        """Drop the drafted levels: keep the ``length`` committed tokens."""
        kv.crop(cache, length)

    def _extend(self, cache: DynamicCache, committed: list[int]) -> torch.Tensor:  # -> [V]
        """Feed the committed tokens the cache lacks (at least the root); logits after the root."""
        start = min(kv.cache_length(cache), len(committed) - 1)
        kv.crop(cache, start)
        ids = torch.tensor([committed[start:]], dtype=torch.long, device=self.model.device)
        out = self.model(input_ids=ids, **kv.cache_argument(self.model, cache), use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().cpu()

    def _forward_level(
        self, cache: DynamicCache, builder: TreeBuilder, level: list[int], cached: list[int], depth: int,
        committed_length: int,
    ) -> torch.Tensor:  # -> [F, V]
        """One SSM forward over the nodes of a level that will be expanded.

        The cache holds the committed tokens, then the ``cached`` nodes in that order; the level's
        nodes are appended, so the keys are [committed | cached | level].
        """
        parents = torch.tensor(builder.parents, dtype=torch.long)
        visible = ancestor_mask(parents)[level][:, cached + level]  # [F, K]
        bias = attention_bias(visible, committed_length, self.model.dtype)
        device = self.model.device
        ids = torch.tensor([[builder.tokens[n] for n in level]], dtype=torch.long, device=device)
        position_ids = torch.full_like(ids, committed_length - 1 + depth)
        out = self.model(input_ids=ids, attention_mask=bias.to(device), position_ids=position_ids,
                         **kv.cache_argument(self.model, cache), use_cache=True)
        return out.logits[0].float().cpu()


class NgramDrafter:
    """Prompt lookup: copy what followed earlier occurrences of the last n tokens.

    A non-neural ensemble member with no state and no cost worth counting; strong where output
    repeats its input (code edits, quoting). Its children are deterministic (point masses).
    """

    def __init__(self, proposer: int, name: str = "ngram", max_ngram: int = 3, min_ngram: int = 1,
                 max_tokens: int = 8, max_matches: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.proposer, self.name = proposer, name
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_tokens, self.max_matches = max_tokens, max_matches

    def new_state(self) -> None:
        return None

    def release(self, state: None) -> None:
        """Stateless."""

    def draft(self, state: None, committed: list[int], spec: DraftSpec, generator: torch.Generator) -> Proposal:
        """Continuations as chains under the root, at most ``spec.max_nodes`` nodes in all."""
        builder = TreeBuilder(root=committed[-1], proposer=self.proposer)
        limit = spec.max_nodes if spec is not None and spec.max_nodes else None
        for continuation in self.continuations(committed):
            parent = 0
            for token in continuation:
                if limit is not None and len(builder.tokens) >= limit and (parent, token) not in builder.index:
                    return builder.build()
                parent = builder.add(parent, token, None)
        return builder.build()

    def continuations(self, committed: list[int]) -> list[list[int]]:
        """Up to ``max_matches`` distinct continuations, longest matching n-gram first, latest first.

        Example: committed [5, 6, 7, 9, 5, 6], max_ngram 2, max_tokens 2 -> [[7, 9]].
        """
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, len(committed) - 1), self.min_ngram - 1, -1):
            pattern = committed[-n:]
            for start in range(len(committed) - n - 1, -1, -1):
                if committed[start : start + n] != pattern:
                    continue
                continuation = committed[start + n : start + n + self.max_tokens]
                if continuation and continuation not in found:
                    found.append(continuation)
                if len(found) == self.max_matches:
                    return found
        return found
