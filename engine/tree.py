"""Token trees: tokens and parent indices in topological order, plus derived views.

A tree is two tensors, ``tokens [N]`` and ``parents [N]``. Node 0 is the root (the last
committed token), ``parents[0] == -1`` and ``parents[i] < i`` for every other node, so any
prefix of the node list is itself a tree. Everything else (depths, positions, paths, the
attention mask) is derived by the small pure functions below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class TokenTree:
    """A token tree in topological order.

    tokens:  # [N] int64, tokens[0] is the root (last committed token)
    parents: # [N] int64, parents[0] == -1, 0 <= parents[i] < i for i >= 1
    """

    tokens: torch.Tensor  # [N]
    parents: torch.Tensor  # [N]

    def __post_init__(self) -> None:
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1:
            raise ValueError("tokens and parents must be 1-D tensors of the same length")
        if self.tokens.numel() == 0 or int(self.parents[0]) != -1:
            raise ValueError("a token tree needs a root at index 0 with parent -1")
        index = torch.arange(self.parents.numel())
        if bool(((self.parents[1:] < 0) | (self.parents[1:] >= index[1:])).any()):
            raise ValueError("parents must satisfy 0 <= parents[i] < i (topological order)")

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @staticmethod
    def root_only(token: int) -> "TokenTree":
        return TokenTree(torch.tensor([token], dtype=torch.long), torch.tensor([-1], dtype=torch.long))


def depths(parents: torch.Tensor) -> torch.Tensor:  # [N] -> [N]
    """Depth of every node (root = 0).

    Example: parents [-1, 0, 1, 0, 3] -> depths [0, 1, 2, 1, 2].
    """
    result = [0] * parents.numel()
    for i, parent in enumerate(parents.tolist()[1:], start=1):
        result[i] = result[parent] + 1
    return torch.tensor(result, dtype=torch.long)


def positions(parents: torch.Tensor, prefix_length: int) -> torch.Tensor:  # [N] -> [N]
    """Position ids: prefix length + depth (the root sits right after the cached prefix).

    Example: parents [-1, 0, 1, 0], prefix_length 5 -> [5, 6, 7, 6].
    """
    return depths(parents) + prefix_length


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:  # [N] -> [N, N] bool
    """mask[i, j] is True exactly when node j is an ancestor of node i or i itself.

    Example: parents [-1, 0, 0, 1] ->
        [[1, 0, 0, 0],
         [1, 1, 0, 0],
         [1, 0, 1, 0],
         [1, 1, 0, 1]]
    """
    size = parents.numel()
    mask = torch.eye(size, dtype=torch.bool)
    for i, parent in enumerate(parents.tolist()[1:], start=1):
        mask[i] |= mask[parent]
    return mask


def attention_bias(
    visible: torch.Tensor,  # [Q, K] bool: which keys each query may see
    prefix_length: int,
    dtype: torch.dtype,
    window: int | None = None,
    query_positions: torch.Tensor | None = None,  # [Q] int64, needed with a window
    key_positions: torch.Tensor | None = None,  # [K] int64, needed with a window
) -> torch.Tensor:  # [1, 1, Q, prefix_length + K]
    """Float additive 4-D mask: 0 where visible, dtype-min elsewhere; the prefix is all visible.

    A bool 4-D mask gives silently wrong logits under eager attention, so the mask is always
    float. Example: visible [[1, 0], [1, 1]], prefix 1 -> [[[[0, 0, min], [0, 0, 0]]]].
    With a sliding ``window`` (``windowed``) a query sees a key only where their positions are less
    than ``window`` apart; the prefix's entries sit at positions 0 .. prefix_length - 1.
    """
    queries = visible.shape[0]
    full = torch.ones(queries, prefix_length + visible.shape[1], dtype=torch.bool)
    full[:, prefix_length:] = visible
    if window is not None:
        keys = torch.cat([torch.arange(prefix_length), key_positions])
        full = windowed(full, query_positions, keys, window)
    bias = torch.zeros(full.shape, dtype=dtype)
    bias.masked_fill_(~full, torch.finfo(dtype).min)
    return bias[None, None]


def windowed(visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
             window: int) -> torch.Tensor:  # visible [Q, K] bool, positions [Q], [K] -> [Q, K] bool
    """``visible`` cut to a sliding window: a query at position q keeps a key at position p only
    when q - p < window (Hugging Face's ``sliding_window_overlay``: the query and window - 1 keys
    before it). Positions, not indices: a tree node at prefix + depth sees an ancestor only inside it.

    Example: visible all True [1, 4], query position [5], keys [2, 3, 4, 5], window 3 -> [[0, 1, 1, 1]].
    """
    inside = query_positions.to(key_positions.device)[:, None] - key_positions[None, :] < window
    return visible & inside.to(visible.device)


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Node indices from the root to ``node``, both included.

    Example: parents [-1, 0, 1, 0, 3], node 4 -> [0, 3, 4].
    """
    path = []
    parent_list = parents.tolist()
    while node != -1:
        path.append(node)
        node = parent_list[node]
    return path[::-1]


def children(parents: torch.Tensor) -> list[list[int]]:
    """Children of every node, in node order.

    Example: parents [-1, 0, 1, 0] -> [[1, 3], [2], [], []].
    """
    result: list[list[int]] = [[] for _ in range(parents.numel())]
    for i, parent in enumerate(parents.tolist()[1:], start=1):
        result[parent].append(i)
    return result


def dfs_order(parents: torch.Tensor) -> list[int]:
    """A depth-first (pre-order) permutation of a topologically ordered tree.

    Example: parents [-1, 0, 0, 1] (BFS order) -> [0, 1, 3, 2].
    """
    kids = children(parents)
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(kids[node]))
    return order


# -- Tree size. One definition everywhere: a tree's size counts its nodes, ROOT INCLUDED (N). ----


def schedule_nodes(schedule: Sequence[int]) -> int:
    """Nodes of the full tree an expansion schedule grows, root included.

    Example: schedule (2, 2, 1) -> 1 + 2 + 4 + 4 = 11.
    """
    total, level = 1, 1
    for width in schedule:
        level *= width
        total += level
    return total


def fit_schedule(schedule: Sequence[int], max_nodes: int) -> tuple[int, ...]:
    """The longest prefix of ``schedule`` whose full tree has at most ``max_nodes`` nodes (root included).

    Decided before drawing, from the schedule alone, so it cannot bias sampled output.
    Example: schedule (3, 2, 1, 1), max_nodes 13 -> sizes 1 + 3 + 6 = 10, + 6 = 16 > 13: (3, 2).
    """
    kept: list[int] = []
    for width in schedule:
        if schedule_nodes(kept + [width]) > max_nodes:
            break
        kept.append(width)
    return tuple(kept)
