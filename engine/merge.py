"""Merge: fold the proposals of several proposers into one token tree, shared prefixes once."""

from __future__ import annotations

from typing import Sequence

import torch

from .draft import Draws, Proposal
from .tree import TokenTree, dfs_order


def merge(proposals: Sequence[Proposal]) -> Proposal:
    """Union of the proposals' trees as a trie in DFS order; every draw is kept.

    Draws are never dropped or deduplicated (a token two SSMs proposed keeps both draws, each
    with its own q), so stochastic verification stays exact. The node budget is applied before
    drafting (see ``engine.tree.fit_schedule``), never here by the drawn tokens.

    Example: proposals with trees (root r) r->a->b and r->a->c, r->d merge to
    tokens [r, a, b, c, d], parents [-1, 0, 1, 1, 0]; node a carries two draws.
    """
    if not proposals:
        raise ValueError("merge needs at least one proposal")
    tokens, parents = [int(proposals[0].tree.tokens[0])], [-1]
    index: dict[tuple[int, int], int] = {}
    remapped = []
    for proposal in proposals:
        mapping = [0]
        for token, parent in zip(proposal.tree.tokens.tolist()[1:], proposal.tree.parents.tolist()[1:]):
            key = (mapping[parent], token)
            if key not in index:
                index[key] = len(tokens)
                tokens.append(token)
                parents.append(mapping[parent])
            mapping.append(index[key])
        remapped.append(torch.tensor(mapping, dtype=torch.long)[proposal.draws.node])
    order = dfs_order(torch.tensor(parents, dtype=torch.long))
    return _reorder(tokens, parents, order, proposals, remapped)


def _reorder(tokens, parents, order, proposals, draw_nodes) -> Proposal:
    """Renumber nodes by ``order`` (a topological permutation) and concatenate the draws."""
    rank = torch.empty(len(order), dtype=torch.long)
    rank[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    new_tokens = torch.tensor(tokens, dtype=torch.long)[order]
    old_parents = torch.tensor(parents, dtype=torch.long)[order]
    new_parents = torch.where(old_parents < 0, old_parents, rank[old_parents.clamp(min=0)])
    draws = Draws(
        node=rank[torch.cat(draw_nodes)] if draw_nodes else torch.zeros(0, dtype=torch.long),
        proposer=torch.cat([p.draws.proposer for p in proposals]),
        q=_concat_q(proposals),
        deterministic=torch.cat([p.draws.deterministic for p in proposals]),
    )
    translated = tuple(entry for p in proposals for entry in p.translated)
    return Proposal(TokenTree(new_tokens, new_parents), draws, translated)


def _concat_q(proposals: Sequence[Proposal]) -> torch.Tensor | None:  # -> [M, V]
    if all(p.draws.q is None for p in proposals):
        return None
    width = next(p.draws.q for p in proposals if p.draws.q is not None).shape[-1]
    rows = [p.draws.q if p.draws.q is not None else torch.zeros(p.draws.node.numel(), width) for p in proposals]
    return torch.cat(rows)
