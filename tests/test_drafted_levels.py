"""The SSM's drafted levels are reused (engine.draft.DraftedLevels): after a step, the next draft feeds
the SSM only the committed tokens its last draft did not expand, and its cache then holds the entries
a plain feed of every committed token makes (float32, to rounding), so it proposes the same tree."""

from __future__ import annotations

import pytest
import torch

from engine import kv
from engine.draft import DraftedLevels, DraftSpec, ModelDrafter
from engine.sampling import make_generator
from tiny_models import tiny_model

# prefix (5, 7); tree 7 -> a(1) -> b(2), 7 -> c(3); nodes 1 then 2 expanded (rows 0, 1), c a leaf.
A, B, C, X = 11, 12, 13, 14
LEVELS = DraftedLevels((5, 7), {(0, A): 1, (1, B): 2, (0, C): 3}, {1: 0, 2: 1}, entries=None)

ROWS = [  # (committed, rows of the accepted tokens whose entries are reused)
    ((5, 7, A, B, X), [0, 1]),  # a and b accepted, x the next root: both reused
    ((5, 7, A, X), [0]),  # a accepted, x not drafted under it
    ((5, 7, A, B), [0]),  # b is the next root: fed again for its logits, never reused
    ((5, 7, C, X), []),  # c accepted, but it was a leaf: nothing of it is cached
    ((5, 7, X), []),  # nothing accepted
    ((5, 9, A, X), []),  # another prefix: the entries were drafted after other tokens
    ((5, 7), []),  # nothing committed past the prefix
]


@pytest.mark.parametrize("committed,rows", ROWS)
def test_rows_follow_the_accepted_tokens_through_the_expanded_nodes(committed, rows):
    assert LEVELS.rows_for(list(committed)) == rows


@pytest.fixture(scope="module")
def ssm():
    return tiny_model("llama", vocab_size=61, layers=2, seed=3, hidden=32)


def fed_lengths(model) -> tuple[list[int], object]:
    """The input lengths of every forward of ``model``, and the hook's handle."""
    lengths: list[int] = []

    def hook(module, args, kwargs):
        lengths.append(int(kwargs["input_ids"].shape[-1]))

    return lengths, model.register_forward_pre_hook(hook, with_kwargs=True)


def entries(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def accepted_chain(proposal, depth: int) -> list[int]:
    """The tokens of the first child chain of a proposal, ``depth`` deep (the accepted path)."""
    tokens, parents, node, path = proposal.tree.tokens.tolist(), proposal.tree.parents.tolist(), 0, []
    for _ in range(depth):
        node = parents.index(node)
        path.append(tokens[node])
    return path


SPECS = [("chain", DraftSpec((1, 1, 1, 1))), ("tree", DraftSpec((2, 2, 1)))]


@pytest.mark.parametrize("name,spec", SPECS)
@pytest.mark.parametrize("reuse", [True, False])
def test_the_next_draft_feeds_only_what_the_last_did_not_expand(ssm, name, spec, reuse):
    """Two steps: the second draft, after 2 accepted tokens and a bonus, feeds the bonus alone when
    the levels are reused, and all 3 when they are dropped (the negative control); either way the
    cache and the proposal equal a fresh drafter's that feeds the committed tokens in one go."""
    drafter, prompt = ModelDrafter(ssm, 0, "ssm"), [4, 9, 17, 3, 22]
    state = drafter.new_state()
    first = drafter.draft(state, prompt, spec, make_generator(0, 1, 1))
    assert drafter.levels_of(state) is not None and drafter.levels_of(state).prefix == tuple(prompt)
    committed = prompt + accepted_chain(first, 2) + [31]  # 31: a bonus token no draft proposed there
    if not reuse:
        drafter.set_levels(state, None)
    lengths, handle = fed_lengths(ssm)
    try:
        second = drafter.draft(state, committed, spec, make_generator(0, 1, 2))
    finally:
        handle.remove()
    assert lengths[0] == (1 if reuse else 3)
    fresh = ModelDrafter(ssm, 0, "fresh")
    reference = fresh.new_state()
    expected = fresh.draft(reference, committed, spec, make_generator(0, 1, 2))
    assert kv.cache_length(state) == kv.cache_length(reference) == len(committed)
    for got, want in zip(entries(state), entries(reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(second.tree.tokens, expected.tree.tokens)
    assert torch.equal(second.tree.parents, expected.tree.parents)


def test_a_released_state_drops_its_levels(ssm):
    drafter = ModelDrafter(ssm, 0, "ssm")
    state = drafter.new_state()
    drafter.draft(state, [4, 9, 17], DraftSpec((2, 1)), make_generator(0, 1, 1))
    assert drafter.levels_of(state) is not None
    drafter.release(state)
    assert drafter.levels_of(state) is None
