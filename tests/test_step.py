"""The one speculative step (engine.step): plan, tree size and admission, outcome, drivers, resync."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.common import NeedsResync, sync_history
from actors.merge import MergeActor
from actors.suffix import SuffixDrafter, tree_proposal
from engine.draft import CHILDREN_RULES, ModelDrafter
from engine.merge import merge
from engine.requests import HOPS, GenerationStats, SpeculationOptions, StepOutcome
from engine.sampling import SamplingParams, make_generator
from engine.step import (Assignment, Drafted, draft_with, merge_drafts, plan_proposers, record_step, run_sync,
                         step_outcome, tree_reservation)
from engine.tree import TokenTree, schedule_nodes
from engine.verify import Verdict
from settings.config import SuffixConfig
from tests.tiny_models import tiny_model

VOCAB = 61
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 8, 5, 6, 7, 5, 6]  # repeats: the suffix proposer finds continuations


@pytest.fixture(scope="module")
def drafters():
    torch.set_num_threads(2)
    ssms = [ModelDrafter(tiny_model("llama", VOCAB, layers=1, seed=s), s, f"ssm{s}") for s in (0, 1)]
    return ssms + [SuffixDrafter(2, SuffixConfig(max_spec_tokens=24, min_token_prob=0.0, max_spec_offset=4.0))]


NAMES, NEURAL = ("ssm0", "ssm1", "suffix"), (True, True, False)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=st.lists(st.integers(1, 3), min_size=1, max_size=4), max_nodes=st.integers(1, 40),
       mode=st.sampled_from(("tree", "sequence", "incremental")), children=st.sampled_from(CHILDREN_RULES),
       temperature=st.sampled_from((0.0, 0.9)), confidence=st.sampled_from((0.0, 0.05)),
       proposers=st.sampled_from((None, ("ssm0",), ("ssm1", "suffix"))))
def test_admission_never_under_reserves(drafters, schedule, max_nodes, mode, children, temperature, confidence,
                                        proposers):
    """Whatever the schedule, rule and proposers, the merged tree fits what admission reserves."""
    options = SpeculationOptions(mode, tuple(schedule), sequence_depth=len(schedule) + 1, children=children,
                                 proposers=proposers, max_tree_nodes=max_nodes, min_confidence=confidence)
    sampling = SamplingParams(temperature=temperature, seed=3)
    plan = plan_proposers(NAMES, NEURAL, options, sampling)
    states = [drafters[a.proposer].new_state() for a in plan]
    drafts = [draft_with(drafters[a.proposer], state, PROMPT, a.spec, a.generator(len(PROMPT))) for a, state in zip(plan, states)]
    for a, state in zip(plan, states):
        drafters[a.proposer].release(state)
    for assignment, drafted in zip(plan, drafts):
        assert drafted.proposal.tree.size <= max_nodes  # each proposer's tree, root included
        assert drafted.proposal.tree.size <= schedule_nodes(assignment.spec.schedule) or not NEURAL[assignment.proposer]
    assert merge_drafts(drafts, PROMPT[-1], 0.0).proposal.tree.size <= tree_reservation(plan)


RESERVATIONS = [  # (mode, expansion, max_tree_nodes, proposers, tokens admission reserves for the tree)
    ("tree", (2, 2, 1, 1), 64, None, 1 + 14 + 14 + 63),  # two SSMs' full 15-node trees, the suffix's budget
    ("tree", (2, 2, 1, 1), 10, None, 1 + 6 + 6 + 9),  # fitted to (2, 2): 7 nodes each
    ("sequence", (2,), 64, None, 5),  # one chain of depth 4
    ("tree", (3,), 64, ("suffix",), 64),
    ("incremental", (2,), 64, None, 1),  # the root alone
]


@pytest.mark.parametrize("mode,expansion,max_nodes,proposers,reserved", RESERVATIONS)
def test_tree_reservation_is_what_the_plan_can_draw(mode, expansion, max_nodes, proposers, reserved):
    options = SpeculationOptions(mode, expansion, sequence_depth=4, proposers=proposers, max_tree_nodes=max_nodes)
    assert tree_reservation(plan_proposers(NAMES, NEURAL, options)) == reserved


PLANS = [  # (mode, proposers, expected (proposer, schedule) pairs in proposer order)
    ("tree", None, [(0, (2, 2, 1)), (1, (2, 2, 1)), (2, (2, 2, 1))]),
    ("tree", ("suffix", "ssm0"), [(0, (2, 2, 1)), (2, (2, 2, 1))]),
    ("sequence", ("suffix", "ssm1"), [(1, (1, 1, 1))]),
    ("incremental", None, []),
]


@pytest.mark.parametrize("mode,proposers,expected", PLANS)
def test_plan_is_in_proposer_order_with_one_stream_each(mode, proposers, expected):
    options = SpeculationOptions(mode, (2, 2, 1), sequence_depth=3, proposers=proposers)
    plan = plan_proposers(NAMES, NEURAL, options, SamplingParams(temperature=1.0, seed=11))
    assert [(a.proposer, a.spec.schedule) for a in plan] == expected
    for a in plan:  # stream i + 1 for proposer i, the target has stream 0; a draft's generator follows the length
        assert torch.equal(a.generator(7).get_state(), make_generator(11, a.proposer + 1, 7).get_state())
        assert not torch.equal(a.generator(7).get_state(), a.generator(8).get_state())


def test_step_outcome_carries_what_statistics_need():
    """Tree r->a->b, r->c; a drawn by proposers 0 and 2, b by 0: accepted a, b, then bonus 9."""
    from engine.draft import Draws, Proposal

    tree = TokenTree(torch.tensor([1, 10, 11, 12]), torch.tensor([-1, 0, 1, 0]))
    draws = Draws(torch.tensor([1, 2, 3, 1]), torch.tensor([0, 0, 1, 2]), None, torch.ones(4, dtype=torch.bool))
    outcome = step_outcome(Drafted(Proposal(tree, draws), 3.0, 1.0), Verdict((0, 1, 2), 9, True), 5.0)
    assert outcome.tokens == (10, 11, 9)
    assert outcome.accepted_depths == (1, 2)
    assert outcome.accepted_by == ((0, 2), (0,))
    assert (outcome.draft_tokens, outcome.draft_ms, outcome.merge_ms, outcome.verify_ms) == (3, 3.0, 1.0, 5.0)


HOP_STEPS = [  # (steps as (draft, merge, verify ms measured where each ran, the step's wall ms), hop_ms)
    # transport: the step's wall time the other hops do not account for (calls, scheduling)
    ([(3.0, 1.0, 5.0, 12.0)], {"draft": 3.0, "merge": 1.0, "verify": 5.0, "transport": 3.0}),
    # steps add up, hop by hop
    ([(3.0, 1.0, 5.0, 12.0), (2.0, 0.5, 4.0, 7.0)], {"draft": 5.0, "merge": 1.5, "verify": 9.0, "transport": 3.5}),
    # a tree drafted ahead (prefetch) ran before the step began: no negative transport
    ([(8.0, 1.0, 5.0, 10.0), (1.0, 1.0, 1.0, 4.0)], {"draft": 9.0, "merge": 2.0, "verify": 6.0, "transport": 1.0}),
]


@pytest.mark.parametrize("steps,hop_ms", HOP_STEPS, ids=["one step", "two steps", "drafted ahead"])
def test_hop_times_split_each_steps_wall_time(steps, hop_ms):
    """GenerationStats.hop_ms (the served replies' hop_ms, the specinfer:step_hop_seconds counter):
    every hop present, verify as verify_ms, and the hops sum to the steps' wall time, each step's
    at least (one whose drafting ran before it began counts that drafting whole)."""
    stats = GenerationStats("tree")
    for draft, merge, verify, wall in steps:
        record_step(stats, StepOutcome((7,), (), (), 2, draft, merge, verify), NAMES, wall)
    assert stats.hop_ms == hop_ms and tuple(stats.hop_ms) == HOPS
    assert stats.hop_ms["verify"] == stats.verify_ms
    assert stats.draft_ms + stats.verify_ms == sum(wall for *_, wall in steps)
    assert sum(stats.hop_ms.values()) == sum(max(wall, sum(inside)) for *inside, wall in steps)


def test_run_sync_refuses_a_coroutine_that_suspends():
    import asyncio

    async def returns():
        return 7

    async def suspends():
        await asyncio.sleep(0)

    assert run_sync(returns()) == 7
    with pytest.raises(RuntimeError, match="suspended"):
        run_sync(suspends())


HISTORIES = [  # (history, start, new, expected or None for NeedsResync)
    ([5, 6], 2, [7], [5, 6, 7]),
    ([5, 6], 0, [1, 2, 3], [1, 2, 3]),  # a full resync replaces
    ([5, 6, 7], 2, [9], [5, 6, 9]),  # a repeated call overwrites from its offset
    ([], 2, [7], None),  # the actor lost the start: NeedsResync
]


@pytest.mark.parametrize("history,start,new,expected", HISTORIES)
def test_sync_history(history, start, new, expected):
    history = list(history)
    if expected is None:
        with pytest.raises(NeedsResync):
            sync_history(history, start, new)
    else:
        sync_history(history, start, new)
        assert history == expected


def test_merge_actor_keeps_plan_order_and_asks_for_a_resync():
    """The suffix proposal takes its place in proposer order, not 'last'; deltas extend history."""
    from engine.draft import DraftSpec

    actor = MergeActor(SuffixConfig(max_spec_tokens=3), suffix_index=0, torch_threads=1, request_ttl_s=60)
    spec = DraftSpec((1,), max_nodes=8)
    plan = (Assignment(0, spec), Assignment(1, spec))

    def ssm(history: list[int]):  # stands in for an SSM's draft (proposer 1)
        return tree_proposal(history[-1], 1, [9, 8], [-1, 0], 8)

    with pytest.raises(NeedsResync):
        actor.merge("r", 5, [1], plan, Drafted(ssm(PROMPT)))
    suffix, state = SuffixDrafter(0, SuffixConfig(max_spec_tokens=3)), None
    for history, start in ((PROMPT[:-2], 0), (PROMPT, len(PROMPT) - 2)):  # a full history, then a delta
        merged = actor.merge("r", start, history[start:], plan, Drafted(ssm(history)))
        state = state or suffix.new_state()
        expected = merge([suffix.draft(state, history, spec), ssm(history)])  # the suffix (proposer 0) first
        assert expected.tree.size > 3  # both proposed
        assert torch.equal(merged.proposal.tree.tokens, expected.tree.tokens)
        assert torch.equal(merged.proposal.tree.parents, expected.tree.parents)
        assert torch.equal(merged.proposal.draws.proposer, expected.draws.proposer)  # the suffix's draws first
    assert actor.release("r") and actor.merge("r", 0, PROMPT, plan, None) is None


def test_the_plan_carries_adaptive_to_every_proposer():
    options = SpeculationOptions("tree", (2, 1), adaptive=False)
    assert [a.spec.adaptive for a in plan_proposers(NAMES, NEURAL, options)] == [False, False, False]
    assert all(a.spec.adaptive for a in plan_proposers(NAMES, NEURAL, SpeculationOptions("tree", (2, 1))))
