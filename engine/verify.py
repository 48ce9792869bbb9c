"""Verification: pure functions from (tree, target output) to the accepted path.

Nothing here keeps counters or touches caches; randomness comes from an explicit generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft import Proposal
from .tree import TokenTree, children


@dataclass(frozen=True)
class Verdict:
    """path: accepted node indices, root first (so len(path) - 1 tokens were accepted).
    next_token: the target's own token after the path: the *recovered* token when the last
    accepted node had children and none was accepted, else the *bonus* token."""

    path: tuple[int, ...]
    next_token: int
    bonus: bool


def verify_greedy(tree: TokenTree, target_tokens: torch.Tensor) -> Verdict:  # target_tokens [N]
    """Follow the child equal to the target's argmax at each node, from the root.

    Example: tokens [r, 7, 8, 9], parents [-1, 0, 1, 0], target argmax per node [7, 5, 1, 2]:
    the root's child 7 matches (node 1); node 1 wants 5, its only child is 8: stop.
    Result: path (0, 1), next_token 5 (recovered).
    """
    kids = children(tree.parents)
    tokens, wanted = tree.tokens.tolist(), target_tokens.tolist()
    node, path = 0, [0]
    while True:
        match = next((c for c in kids[node] if tokens[c] == wanted[node]), None)
        if match is None:
            return Verdict(tuple(path), wanted[node], bonus=not kids[node])
        node = match
        path.append(node)


def verify_stochastic(
    proposal: Proposal,
    target_probs: torch.Tensor,  # [N, V] the target's warped distribution p at every node
    generator: torch.Generator,
) -> Verdict:
    """Multi-step speculative sampling (SpecInfer) over the draws, generalised per draw.

    At node u the draws under u are tried in draw order. Draw s with token x and stored q_s is
    accepted with probability min(1, r(x) / q_s(x)) under the current residual r (r = p at
    first); on rejection r <- normalize(max(0, r - q_s)). A deterministic draw is a point mass,
    so that rule reads: accept with probability r(x), else r(x) <- 0 and renormalise (naive
    sampling). A without-replacement draw stores q with the earlier draws zeroed (SpecTree).
    When every draw is rejected, the recovered token is drawn from r; after an accepted leaf
    the bonus token is drawn from p. Lossless for any draws whose q is exact.
    """
    draws_under = _draws_by_parent(proposal)
    node, path = 0, [0]
    while True:
        residual = target_probs[node].double()
        accepted = None
        for draw in draws_under[node]:
            token = int(proposal.tree.tokens[int(proposal.draws.node[draw])])
            residual, ok = _try_draw(proposal, draw, token, residual, generator)
            if ok:
                accepted = int(proposal.draws.node[draw])
                break
        if accepted is None:
            next_token = int(torch.multinomial(residual.float(), 1, generator=generator))
            return Verdict(tuple(path), next_token, bonus=not draws_under[node])
        node = accepted
        path.append(node)


def _try_draw(proposal: Proposal, draw: int, token: int, residual: torch.Tensor, generator):
    """One MSS trial: (new residual, accepted?)."""
    coin = float(torch.rand((), generator=generator, dtype=torch.float64))
    if bool(proposal.draws.deterministic[draw]):
        if coin < float(residual[token]):
            return residual, True
        residual = residual.clone()
        residual[token] = 0.0
    else:
        q = proposal.draws.q[draw].double()
        if coin < min(1.0, float(residual[token] / q[token])):
            return residual, True
        residual = (residual - q).clamp(min=0.0)
    total = float(residual.sum())
    if total <= 1e-12:  # r == q up to rounding: the acceptance probability was 1
        return residual, True
    return residual / total, False


def _draws_by_parent(proposal: Proposal) -> list[list[int]]:
    """Draw indices grouped by the parent of the node they name, in draw order."""
    groups: list[list[int]] = [[] for _ in range(proposal.tree.size)]
    parents = proposal.tree.parents.tolist()
    for draw, node in enumerate(proposal.draws.node.tolist()):
        groups[parents[node]].append(draw)
    return groups
