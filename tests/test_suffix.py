"""The suffix-tree proposer (actors.suffix): valid trees within budget, the request's own repeats,
the global store across requests (and its absence for non-adaptive requests), release, eviction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.merge import MergeActor
from actors.suffix import SuffixDrafter, tree_proposal
from engine.draft import DraftSpec
from engine.step import Assignment
from settings.config import SuffixConfig


def spec(max_nodes: int | None = 64, adaptive: bool = True) -> DraftSpec:
    return DraftSpec((1,), max_nodes=max_nodes, adaptive=adaptive)


def tokens_of(proposal) -> list[int]:
    return proposal.tree.tokens.tolist()


def run_request(drafter: SuffixDrafter, prompt: list[int], output: list[int], adaptive: bool = True) -> int:
    """One whole request: a draft after each committed output token, then release. Its key."""
    state = drafter.new_state()
    for end in range(1, len(output) + 1):
        drafter.draft(state, prompt + output[:end], spec(adaptive=adaptive))
    drafter.release(state)
    return state.key


@settings(max_examples=60)
@given(committed=st.lists(st.integers(0, 5), min_size=2, max_size=60),
       max_nodes=st.one_of(st.none(), st.integers(1, 40)), adaptive=st.booleans(), steps=st.integers(1, 4))
def test_proposals_are_trees_within_the_budget(committed, max_nodes, adaptive, steps):
    """Whatever the history: a valid tree rooted at the last committed token, at most max_nodes
    nodes (root included) and max_spec_tokens below the root, deterministic children, one node
    per (parent, token)."""
    drafter = SuffixDrafter(3, SuffixConfig(max_spec_tokens=12, min_token_prob=0.0, max_spec_offset=4.0))
    state = drafter.new_state()
    for end in sorted({max(2, len(committed) * i // steps) for i in range(1, steps + 1)}):  # a growing request
        proposal = drafter.draft(state, committed[:end], spec(max_nodes, adaptive))
        tree, draws = proposal.tree, proposal.draws  # TokenTree checks the topological order
        assert tree.size <= min(max_nodes or 13, 13) and int(tree.tokens[0]) == committed[end - 1]
        assert draws.node.tolist() == list(range(1, tree.size)) and bool(draws.deterministic.all())
        assert set(draws.proposer.tolist()) <= {3} and draws.q is None
        edges = list(zip(tree.parents.tolist()[1:], tree.tokens.tolist()[1:]))
        assert len(set(edges)) == len(edges)
    drafter.release(state)


OWN_REPEATS = [  # (committed, proposed tree tokens, parents): what followed the longest earlier match
    ([3, 5, 9, 3, 5], [5, 9, 3], [-1, 0, 1]),  # [3, 5] was followed by 9, 3
    ([1, 2, 3, 4, 1, 2, 3], [3, 4, 1, 2], [-1, 0, 1, 2]),
    ([7, 7, 7, 7], [7, 7, 7], [-1, 0, 1]),
    ([1, 2, 3, 4], [4], [-1]),  # nothing repeats: the root alone
]


@pytest.mark.parametrize("committed,tokens,parents", OWN_REPEATS)
@pytest.mark.parametrize("adaptive", [True, False])
def test_a_repeated_pattern_is_proposed(committed, tokens, parents, adaptive):
    drafter = SuffixDrafter(0)
    proposal = drafter.draft(drafter.new_state(), committed, spec(adaptive=adaptive))
    assert (tokens_of(proposal), proposal.tree.parents.tolist()) == (tokens, parents)


CAPS = [  # (max_nodes, max_spec_tokens, nodes): [1, 2, 3, 4, 5, 6, 1, 2, 3, 4] proposes 5, 6, 1, 2
    (64, 32, 5),
    (3, 32, 3),  # the tree budget, root included
    (64, 2, 3),  # the configured cap, root excluded
    (1, 32, 1),  # no room below the root
    (None, 3, 4),
]


@pytest.mark.parametrize("max_nodes,cap,nodes", CAPS)
def test_budget_and_cap_bound_the_proposal(max_nodes, cap, nodes):
    drafter = SuffixDrafter(0, SuffixConfig(max_spec_tokens=cap))
    proposal = drafter.draft(drafter.new_state(), [1, 2, 3, 4, 5, 6, 1, 2, 3, 4], spec(max_nodes))
    assert tokens_of(proposal) == [4, 5, 6, 1, 2][:nodes]


GLOBAL_STORE = [  # (first request adaptive, second request adaptive, second proposes the first's output)
    (True, True, True),
    (True, False, False),  # a non-adaptive request reads nothing of others
    (False, True, False),  # nor writes anything others read
    (False, False, False),
]


@pytest.mark.parametrize("writer,reader,shared", GLOBAL_STORE)
def test_the_global_store_carries_outputs_across_adaptive_requests_only(writer, reader, shared):
    drafter = SuffixDrafter(0)
    run_request(drafter, [90, 91], [40, 41, 42, 43, 44, 45])
    drafter.forget_responses()  # the store starts empty for the case under test
    run_request(drafter, [90, 91], [40, 41, 42, 43, 44, 45], adaptive=writer)
    proposal = drafter.draft(drafter.new_state(), [70, 71, 72, 41, 42, 43], spec(adaptive=reader))
    assert tokens_of(proposal) == ([43, 44, 45] if shared else [43])


def test_release_stops_the_request_and_is_idempotent():
    drafter = SuffixDrafter(0)
    idle, state, private = drafter.new_state(), drafter.new_state(), drafter.new_state()
    drafter.draft(state, [1, 2, 3, 1, 2], spec())
    drafter.draft(private, [1, 2, 3, 1, 2], spec(adaptive=False))
    assert len(drafter.shared.active_requests) == 1 and len(drafter.private.active_requests) == 1
    for _ in range(2):
        for s in (idle, state, private):
            drafter.release(s)
    assert not drafter.shared.active_requests and not drafter.private.active_requests
    assert tokens_of(drafter.draft(state, [1, 2, 3, 1, 2, 3], spec())) == [3]  # released: the root alone
    assert not drafter.shared.active_requests
    assert len(drafter.shared.cached_requests) == 1  # its response stays in the global store


def test_max_cached_requests_bounds_the_global_store():
    """Requests through a store of two responses, evicted first in, first out; a request takes its
    slot when it starts."""
    drafter = SuffixDrafter(0, SuffixConfig(max_cached_requests=2))
    keys = [run_request(drafter, [1], [first + i for i in range(4)]) for first in (10, 20, 30)]
    assert list(drafter.shared.cached_requests) == keys[1:]  # the first response is gone
    reader = drafter.new_state()
    assert tokens_of(drafter.draft(reader, [5, 6, 30, 31], spec())) == [31, 32, 33]
    assert list(drafter.shared.cached_requests) == [keys[2], reader.key]  # the reader evicted the second
    committed = [5, 6, 30, 31]
    for evicted in (10, 20):  # the reader's committed tokens grow; nothing follows the evicted patterns
        committed += [7, evicted, evicted + 1]
        assert tokens_of(drafter.draft(reader, committed, spec())) == [evicted + 1]


def test_zero_cached_requests_switches_the_global_store_off():
    drafter = SuffixDrafter(0, SuffixConfig(max_cached_requests=0))
    run_request(drafter, [1], [10, 11, 12, 13])
    assert not drafter.shared.cached_requests
    assert tokens_of(drafter.draft(drafter.new_state(), [5, 6, 10, 11], spec())) == [11]


TREES = [  # (tokens, parents, max_nodes, expected tree tokens, parents)
    ([9, 7, 3], [-1, -1, 0], 3, [5, 9, 7], [-1, 0, 0]),  # the docstring's example
    ([9, 7, 3], [-1, -1, 0], 8, [5, 9, 7, 3], [-1, 0, 0, 1]),
    ([9, 9], [-1, -1], 8, [5, 9], [-1, 0]),  # one node per (parent, token)
    ([], [], 8, [5], [-1]),
]


@pytest.mark.parametrize("tokens,parents,max_nodes,tree_tokens,tree_parents", TREES)
def test_tree_proposal(tokens, parents, max_nodes, tree_tokens, tree_parents):
    proposal = tree_proposal(5, 2, tokens, parents, max_nodes)
    assert (tokens_of(proposal), proposal.tree.parents.tolist()) == (tree_tokens, tree_parents)


def test_tree_proposal_needs_parents_first():
    with pytest.raises(ValueError, match="parents must come first"):
        tree_proposal(5, 0, [9, 7], [1, -1], 8)


@pytest.mark.parametrize("drop", ["release", "expire"])
def test_the_merge_actor_drops_a_request_s_suffix_state(drop):
    actor = MergeActor(SuffixConfig(), suffix_index=0, torch_threads=1, request_ttl_s=60)
    plan = (Assignment(0, spec()),)
    merged = actor.merge("r", 0, [1, 2, 3, 1, 2], plan)
    assert tokens_of(merged.proposal) == [2, 3, 1] and len(actor.suffix.shared.active_requests) == 1
    assert actor.release("r") if drop == "release" else actor.sweep(max_idle_s=-1.0) == ["r"]
    assert not actor.suffix.shared.active_requests
    assert actor.merge("r", 0, [1, 2, 3, 1, 2], plan) is None  # released ids stay released


def test_merge_actor_without_the_suffix_proposer():
    actor = MergeActor(None, suffix_index=0, torch_threads=1, request_ttl_s=60)
    assert actor.ready() is None
    merged = actor.merge("r", 0, [1, 2, 3], ())
    assert tokens_of(merged.proposal) == [3]
    assert torch.equal(merged.proposal.draws.node, torch.zeros(0, dtype=torch.long))
