"""Properties of token trees, merge, greedy verification and cache commit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from engine import kv
from engine.draft import Draws, Proposal
from engine.step import take_new_tokens
from engine.merge import merge
from engine.tree import (TokenTree, ancestor_mask, attention_bias, children, depths, dfs_order, fit_schedule,
                         path_to, positions, schedule_nodes)
from engine.verify import verify_greedy


@st.composite
def trees(draw, max_nodes=24, vocab=6):
    size = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)]
    tokens = [draw(st.integers(0, vocab - 1)) for _ in range(size)]
    return TokenTree(torch.tensor(tokens), torch.tensor(parents))


def proposal_of(tree: TokenTree, proposer: int) -> Proposal:
    nodes = torch.arange(1, tree.size)
    draws = Draws(nodes, torch.full_like(nodes, proposer), None, torch.ones(tree.size - 1, dtype=torch.bool))
    return Proposal(tree, draws)


def token_paths(tree: TokenTree) -> list[tuple[int, ...]]:
    return [tuple(tree.tokens[path_to(tree.parents, n)].tolist()) for n in range(tree.size)]


@given(trees(), st.integers(0, 50))
def test_mask_is_ancestors_or_self_and_positions_are_prefix_plus_depth(tree, prefix):
    mask = ancestor_mask(tree.parents)
    for node in range(tree.size):
        path = path_to(tree.parents, node)
        assert set(torch.nonzero(mask[node]).flatten().tolist()) == set(path)
        assert int(positions(tree.parents, prefix)[node]) == prefix + len(path) - 1
    assert depths(tree.parents).tolist() == [len(path_to(tree.parents, n)) - 1 for n in range(tree.size)]


@given(trees(), st.integers(0, 5))
def test_attention_bias_is_float_additive(tree, prefix):
    bias = attention_bias(ancestor_mask(tree.parents), prefix, torch.float32)
    assert bias.shape == (1, 1, tree.size, prefix + tree.size) and bias.dtype == torch.float32
    visible = bias[0, 0] == 0
    assert visible[:, :prefix].all()
    assert torch.equal(visible[:, prefix:], ancestor_mask(tree.parents))
    assert (bias[0, 0][~visible] == torch.finfo(torch.float32).min).all()


@given(trees())
def test_dfs_order_is_a_topological_permutation(tree):
    order = dfs_order(tree.parents)
    assert sorted(order) == list(range(tree.size)) and order[0] == 0
    rank = {node: i for i, node in enumerate(order)}
    assert all(rank[int(p)] < rank[i] for i, p in enumerate(tree.parents.tolist()) if p >= 0)


@settings(max_examples=60)
@given(st.lists(trees(), min_size=1, max_size=4), st.integers(0, 5))
def test_merge_keeps_every_proposed_path_once(tree_list, root):
    tree_list = [TokenTree(torch.cat([torch.tensor([root]), t.tokens[1:]]), t.parents) for t in tree_list]
    merged = merge([proposal_of(t, i) for i, t in enumerate(tree_list)])
    merged_paths = token_paths(merged.tree)
    assert len(merged_paths) == len(set(merged_paths))
    assert set(merged_paths) == {p for t in tree_list for p in token_paths(t)}
    assert dfs_order(merged.tree.parents) == list(range(merged.tree.size))
    assert merged.draws.node.numel() == sum(t.size - 1 for t in tree_list)
    for proposer, tree in enumerate(tree_list):  # each draw names a node with its own token path
        drawn = merged.draws.node[merged.draws.proposer == proposer].tolist()
        assert sorted(merged_paths[n] for n in drawn) == sorted(token_paths(tree)[1:])


@pytest.mark.parametrize(
    "tokens,parents,argmax,path,next_token,bonus",
    [
        ([9], [-1], [4], (0,), 4, True),
        ([9, 7, 8, 9], [-1, 0, 1, 0], [7, 5, 1, 2], (0, 1), 5, False),
        ([9, 7, 8, 9], [-1, 0, 1, 0], [9, 5, 1, 3], (0, 3), 3, True),
        ([9, 7, 8, 9], [-1, 0, 1, 0], [7, 8, 6, 2], (0, 1, 2), 6, True),
        ([9, 7, 8, 9], [-1, 0, 1, 0], [1, 8, 6, 2], (0,), 1, False),
    ],
)
def test_verify_greedy(tokens, parents, argmax, path, next_token, bonus):
    verdict = verify_greedy(TokenTree(torch.tensor(tokens), torch.tensor(parents)), torch.tensor(argmax))
    assert (verdict.path, verdict.next_token, verdict.bonus) == (path, next_token, bonus)


@pytest.mark.parametrize("prefix,nodes,path", [(4, 5, [0, 1, 2]), (4, 5, [0, 3, 4]), (0, 3, [0, 2]), (6, 1, [0])])
def test_keep_path_equals_gather(prefix, nodes, path):
    cache = DynamicCache()
    keys = torch.randn(1, 2, prefix + nodes, 4)
    values = torch.randn(1, 2, prefix + nodes, 4)
    cache.update(keys.clone(), values.clone(), 0)
    kv.keep_path(cache, prefix, path)
    keep = list(range(prefix)) + [prefix + n for n in path]
    assert torch.equal(cache.layers[0].keys, keys[:, :, keep])
    assert torch.equal(cache.layers[0].values, values[:, :, keep])


@pytest.mark.parametrize(
    "schedule,budget,expected",
    [((3, 2, 1, 1), 12, (3, 2)), ((3, 2, 1, 1), 22, (3, 2, 1, 1)), ((3, 2, 1, 1), 21, (3, 2, 1)), ((4,), 4, ()),
     ((4,), 5, (4,)), ((1,) * 6, 4, (1,) * 3), ((2, 2), 1, ())],
)
def test_fit_schedule(schedule, budget, expected):
    """Tree sizes count the root: (3, 2, 1, 1) grows 1 + 3 + 6 + 6 + 6 = 22 nodes."""
    assert fit_schedule(schedule, budget) == expected
    assert schedule_nodes(expected) <= budget


@pytest.mark.parametrize("schedule,nodes", [((), 1), ((2,), 3), ((2, 2, 1), 11), ((3, 2, 1, 1), 22)])
def test_schedule_nodes(schedule, nodes):
    assert schedule_nodes(schedule) == nodes


@pytest.mark.parametrize(
    "new,generated,limit,eos,expected",
    [
        ([4, 2, 9], 5, 10, {2}, ([4, 2], "stop")),
        ([4, 5, 9], 8, 10, {2}, ([4, 5], "length")),
        ([4, 5], 0, 10, {2}, ([4, 5], None)),
        ([4, 2], 8, 10, {2}, ([4, 2], "stop")),
    ],
)
def test_take_new_tokens(new, generated, limit, eos, expected):
    assert take_new_tokens(new, generated, limit, eos) == expected


def test_children_lists():
    assert children(torch.tensor([-1, 0, 1, 0])) == [[1, 3], [2], [], []]


def test_tree_rejects_non_topological_parents():
    with pytest.raises(ValueError, match="topological"):
        TokenTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))


LEVELS = [  # (parents, cached, level, what each level node sees among cached + level)
    ([-1, 0, 0, 1], [1, 2], [3], [[1, 0, 1]]),  # the docstring's example
    ([-1, 0, 0], [], [1, 2], [[1, 0], [0, 1]]),  # the first level: siblings do not see each other
    ([-1, 0, 1, 2], [1, 2], [3], [[1, 1, 1]]),  # a chain sees every earlier level
]


@pytest.mark.parametrize("parents,cached,level,visible", LEVELS)
def test_level_visibility(parents, cached, level, visible):
    from engine.draft import TreeBuilder, level_visibility

    builder = TreeBuilder(root=0, proposer=0)
    for node, parent in enumerate(parents[1:], start=1):
        builder.add(parent, 100 + node, None)
    assert level_visibility(builder, level, cached).tolist() == [[bool(x) for x in row] for row in visible]
