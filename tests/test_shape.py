"""Cost-aware tree shapes (engine.shape): the cost model's pure functions, the drafter's trees,
greedy exactness (fp32, plain and paged), and the sampled output's distribution, with a negative
control (re-ranking *sampled* children, which the policy never does, is caught)."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.suffix import SuffixDrafter
from engine.draft import DraftSpec, ModelDrafter, Proposal, TreeBuilder
from engine.generate import SpeculativeEngine
from engine.paged_models import PagedDrafter, PagedTarget, paged_parts
from engine.requests import GenerationRequest, SpeculationOptions
from engine.sampling import SamplingParams, make_generator
from engine.shape import (PRIOR, BatchLoad, Calibration, ModelFreeLead, ShapeHistory, TreeCost, best_size,
                          frontier_to_expand, step_ms)
from engine.step import plan_proposers
from engine.target import TargetModel
from engine.tree import depths
from tests.lookup_models import LookupDrafter, LookupLM, chi_square, prefix_distribution
from tests.test_distribution import (PROMPT, SAMPLES, SSM_A, T1, TARGET, THRESHOLD, Walk, report, sample_walks, summary,
                                     walk_pool)
from tests.tiny_models import IdTokenizer, reference_greedy, tiny_model

FLAT = TreeCost(((1, 10.0), (64, 10.0)))  # verifying more tokens is free: big trees pay
STEEP = TreeCost(((1, 10.0), (2, 20.0)))  # every token doubles the pass: no tree pays
# For drafting runs, whose measured drafting ms enter the rate: passes so long (or so steep) that
# no pause of the machine can tip a decision, so the chosen sizes are certain.
SLOW_FLAT = TreeCost(((1, 1e6), (64, 1e6)))
SLOW_STEEP = TreeCost(((1, 10.0), (2, 1e6)))

# -- The pure functions. ---------------------------------------------------------------------


@pytest.mark.parametrize("curve,size,ms", [
    (((1, 100.0), (4, 130.0)), 1, 100.0),
    (((1, 100.0), (4, 130.0)), 2, 110.0),
    (((1, 100.0), (4, 130.0)), 7, 160.0),  # beyond the last size: the last slope
    (((1, 100.0),), 50, 100.0),
    (((1, 5.0), (2, 6.0), (4, 10.0)), 3, 8.0),
])
def test_verify_cost_interpolates(curve, size, ms):
    assert TreeCost(curve).verify(size) == pytest.approx(ms)


@pytest.mark.parametrize("curve", [(), ((2, 1.0),)])
def test_cost_needs_the_one_token_pass(curve):
    with pytest.raises(ValueError, match="one-token"):
        TreeCost(curve)


@pytest.mark.parametrize("probs,draft_ms,cost,limit,expected", [
    ([0.9, 0.5, 0.1], 20.0, TreeCost(((1, 100.0), (2, 110.0))), 10, 2),  # the docstring's example
    ([0.9, 0.5, 0.1], 20.0, TreeCost(((1, 100.0), (2, 110.0))), 1, 1),  # the limit
    ([0.9, 0.5, 0.1], 20.0, FLAT, 10, 3),  # free verification: keep everything
    ([0.9, 0.5, 0.1], 0.0, STEEP, 10, 0),  # nothing pays: plain decoding
    ([0.9, 0.5, 0.1], 20.0, STEEP, 10, 2),  # ... unless drafting was paid for already (a sunk cost)
    ([], 20.0, FLAT, 10, 0),
])
def test_best_size(probs, draft_ms, cost, limit, expected):
    assert best_size(probs, Calibration(), draft_ms, cost, limit)[0] == expected


@pytest.mark.parametrize("draft_ms,verify_ms,overlap,ms", [
    (20.0, 100.0, 0.0, 120.0),  # no prefetch: they take turns
    (20.0, 100.0, 0.75, 105.0),  # the docstring's example
    (20.0, 100.0, 1.0, 100.0),  # every tree drafted ahead: the step is the verification
    (300.0, 100.0, 1.0, 300.0),  # ... or the drafting, when that is the longer
])
def test_step_ms_hides_the_shorter_side_in_the_overlapped_share(draft_ms, verify_ms, overlap, ms):
    assert step_ms(draft_ms, verify_ms, overlap) == pytest.approx(ms)


def test_overlap_is_the_faded_hit_rate_with_a_prior_of_one_miss():
    history = ShapeHistory()
    assert history.overlap == 0.0
    for _ in range(3):
        history.record_prefetch(True)
    assert history.overlap == pytest.approx(2.71 / 3.71)  # the docstring's example
    for _ in range(30):
        history.record_prefetch(False)
    assert history.overlap < 0.05


def test_overlapped_drafting_changes_the_kept_size():
    """On a steep curve (10 ms a token) a 20 ms draft taken in turn is a sunk cost that a bigger
    tree spreads out: 2 nodes (rates 1/30, 1.9/40, 2.4/50, 2.5/60). Hidden behind verification the
    step is max(draft, verify): one node fills the pass up to 20 ms (1/20, 1.9/20, 2.4/30)."""
    probs = [0.9, 0.5, 0.1]
    assert best_size(probs, Calibration(), 20.0, STEEP, 10, overlap=0.0)[0] == 2
    assert best_size(probs, Calibration(), 20.0, STEEP, 10, overlap=1.0)[0] == 1


TEN_A_TOKEN = TreeCost(((1, 100.0), (2, 110.0)))  # 100 ms, then 10 ms for every extra token


@pytest.mark.parametrize("probs,load,expected", [
    ([0.9, 0.5, 0.1], BatchLoad(), 2),  # alone: the docstring's first example
    ([0.9, 0.5, 0.1], BatchLoad(14, 14.0), 1),  # 7 others (the second): 15/260, 15.9/270, 16.4/280
    ([0.3, 0.2], BatchLoad(14, 14.0), 0),  # 15/260 > 15.3/270: plain decoding pays the batch more
    ([0.3, 0.2], BatchLoad(), 2),  # ... while alone the same nodes pay: 1/120, 1.3/130, 1.5/140
    ([0.3, 0.2], BatchLoad(14, 2.0), 2),  # others that commit little: the step's ms matter less
])
def test_under_load_the_size_maximises_the_batch_goodput(probs, load, expected):
    """Under continuous batching a request's extra tokens slow every request of the pass (SmartSpec's
    goodput): the size that pays alone may not pay the batch, down to none."""
    cost = replace(TEN_A_TOKEN, load=load)
    assert best_size(probs, Calibration(), 20.0, cost, 10)[0] == expected


def test_the_load_is_not_part_of_a_costs_identity():
    """A tree drafted ahead under one step's load serves the next draft call (engine.prefetch
    compares specs): the load is a hint, not what the spec asks for."""
    assert replace(TEN_A_TOKEN, load=BatchLoad(14, 14.0)) == TEN_A_TOKEN


def test_running_load_counts_the_others():
    from engine.budget import RunningLoad

    load = RunningLoad(fade=0.5)
    load.join("a")
    load.record("a", 5, 3)
    load.join("b")  # the docstring's example
    assert (load.others("a"), load.others("b")) == (BatchLoad(1, 1.0), BatchLoad(5, 2.0))
    load.record("gone", 9, 9)  # a request that left (or never joined) is not counted
    load.leave("a")
    assert load.others("b") == BatchLoad(0, 0.0)


def test_calibration_learns_from_history():
    calibration = Calibration()
    assert calibration.acceptance(0.4) == pytest.approx(0.4)  # the prior: confidence is acceptance
    for i in range(10):
        calibration.record(0.5, i < 2)
    overall = (2 + PRIOR) / (5 + PRIOR)
    assert calibration.acceptance(0.5) == pytest.approx(0.5 * (2 + PRIOR * overall) / (5 + PRIOR))
    assert calibration.acceptance(0.05) == pytest.approx(0.05 * overall)  # an empty bin: the overall ratio
    for _ in range(50):
        calibration.record(0.05, True)  # an under-confident SSM: accepted at p 0.05 every time
    assert calibration.acceptance(0.05) > 0.5  # learned: 0.03 before


def test_a_request_whose_trees_stopped_paying_tries_again():
    """All nodes rejected: acceptance falls; with nothing proposed after, the history fades and the
    prior comes back (the request drafts again instead of never)."""
    history = ShapeHistory()
    history.last = (5, [5, 10, 11, 12], [-1, 0, 1, 0], [1.0, 0.9, 0.8, 0.05])
    history.observe([1, 2, 3, 4, 5, 42])
    low = history.calibration.acceptance(0.9)
    for _ in range(30):
        history.observe([1, 2, 3, 4, 5, 42])  # steps without a proposal
    assert low < 0.6 and history.calibration.acceptance(0.9) > 0.85


@pytest.mark.parametrize("level_ms,cost,expected", [
    ([1.0], FLAT, 1),  # a cheap level, free verification
    ([500.0], FLAT, 0),  # a level costs more than it can bring
    ([1.0], STEEP, 0),  # verification too dear for any tree
])
def test_frontier_to_expand(level_ms, cost, expected):
    assert frontier_to_expand([0.8, 0.1], [0.8], 0.9, Calibration(), 5.0, level_ms, cost, 64) == expected


@pytest.mark.parametrize("frontier,level_ms,expected", [
    ([0.8, 0.1], [10.0, 30.0], 1),  # the docstring's example: the confident node alone, a cheap forward
    ([0.8, 0.1], [10.0, 10.0], 2),  # the same forward either way: both pay
    ([0.8, 0.7], [10.0, 30.0], 2),  # two confident nodes are worth the dearer forward
    ([0.02, 0.01], [10.0, 30.0], 0),  # nothing left worth a forward: stop
])
def test_a_level_expands_the_nodes_that_pay(frontier, level_ms, expected):
    flat = TreeCost(((1, 100.0), (64, 100.0)))
    assert frontier_to_expand([0.8, 0.1], frontier, 0.9, Calibration(), 5.0, level_ms, flat, 64) == expected


def test_a_level_hidden_behind_verification_pays():
    """A 500 ms level beside a 1000 ms pass: drafted in turn it costs more than its expected token
    brings; drafted during the previous verification it is free."""
    slow = TreeCost(((1, 1000.0), (64, 1000.0)))
    args = ([0.8, 0.1], [0.8], 0.9, Calibration(), 5.0, [500.0], slow, 64)
    assert frontier_to_expand(*args, overlap=0.0) == 0
    assert frontier_to_expand(*args, overlap=1.0) == 1


@pytest.mark.parametrize("committed,accepted", [
    ([1, 2, 3, 4, 5, 10, 11, 99], {1, 2}),  # r->10->11 accepted, then the target's own token
    ([1, 2, 3, 4, 5, 12, 7], {3}),
    ([1, 2, 3, 4, 5, 42], set()),
    ([1, 2, 3, 4, 5], set()),  # nothing committed since: nothing scored
])
def test_history_scores_the_last_tree(committed, accepted):
    history = ShapeHistory()
    # drafted at length 5: root r (5) -> 10 -> 11, r -> 12; path probabilities 0.8, 0.6, 0.1
    history.last = (5, [5, 10, 11, 12], [-1, 0, 1, 0], [1.0, 0.8, 0.6, 0.1])
    history.observe(committed)
    seen = sum(history.calibration.mass)
    assert seen == (0.0 if len(committed) == 5 else pytest.approx(1.5))
    assert sum(history.calibration.accepted) == len(accepted)
    assert history.last is None


# -- The drafter's trees. --------------------------------------------------------------------


def is_tree_by_rank(proposal: Proposal, max_nodes: int) -> bool:
    parents = proposal.tree.parents.tolist()
    return proposal.tree.size <= max_nodes and all(0 <= p < i for i, p in enumerate(parents) if i)


@settings(max_examples=30)
@given(st.integers(1, 5), st.integers(1, 5), st.integers(1, 6), st.integers(2, 40),
       st.floats(0.0, 50.0), st.integers(0, 10_000))
def test_cost_aware_trees_are_trees_within_budget(beam, branch, depth, max_nodes, slope, seed):
    cost = TreeCost(((1, 10.0), (2, 10.0 + slope)), beam, branch, depth)
    drafter = LookupDrafter(SSM_A, 0, "ssm")
    spec = DraftSpec((1,), "top_k", SamplingParams(), max_nodes=max_nodes, cost=cost)
    committed = [3, 5, seed % 12, (seed // 12) % 12]
    proposal = drafter.draft(drafter.new_state(), committed, spec, make_generator(seed, 1))
    assert is_tree_by_rank(proposal, max_nodes)
    assert bool(proposal.draws.deterministic.all()) and proposal.draws.q is None
    assert proposal.tree.size - 1 <= beam * branch * (depth - 1) + branch


class CountingDrafter(LookupDrafter):
    """A lookup drafter that records how many nodes each level forward took; a forward takes the
    ms ``forward_ms`` gives (linear between its sizes), which is also what it believes at start."""

    def __init__(self, lm: LookupLM, forward_ms: dict[int, float]):
        super().__init__(lm, 0, "ssm", level_ms=lambda nodes: self.level_costs(nodes)[-1])
        self.forward_ms, self.widths = dict(forward_ms), []

    def _forward_level(self, cache, builder, level, *rest) -> torch.Tensor:  # -> [F, V]
        self.widths.append(len(level))
        return super()._forward_level(cache, builder, level, *rest)


# From (3, 5), every step of its greedy path gives the top token at least 0.97 (seed 4, used before,
# drops to 0.50 at the second step, where a 1 ms level no longer pays against a 10 ms pass).
CONFIDENT = LookupLM(12, seed=10, scale=20.0)


@pytest.mark.parametrize("forward_ms,widths", [
    ({1: 1.0, 4: 4.0}, [1] * 7),  # a one-node forward is cheaper: the confident chain alone, to max_depth
    ({1: 1.0, 4: 1.0}, [4] * 7),  # control: the whole beam costs the same, so it is all expanded
])
def test_a_confident_stretch_grows_as_a_chain(forward_ms, widths):
    drafter = CountingDrafter(CONFIDENT, forward_ms)
    spec = DraftSpec((1,), "top_k", SamplingParams(), max_nodes=64, cost=FLAT)
    proposal = drafter.draft(drafter.new_state(), [3, 5], spec, make_generator(0, 1))
    assert drafter.widths == widths
    assert int(depths(proposal.tree.parents).max()) == FLAT.max_depth


def mean_tree(cost: TreeCost, adaptive: bool = True, children: str = "top_k") -> float:
    drafter, sizes = LookupDrafter(SSM_A, 0, "ssm"), []
    spec = DraftSpec((2, 1), children, T1, max_nodes=64, cost=cost, adaptive=adaptive)
    for seed in range(40):
        state = drafter.new_state()
        sizes.append(drafter.draft(state, [3, 5, seed % 12], spec, make_generator(seed, 1)).tree.size)
        drafter.release(state)
    return sum(sizes) / len(sizes)


def test_the_curve_sets_the_size():
    assert mean_tree(SLOW_FLAT) > 8 and mean_tree(SLOW_STEEP) == 1.0


@pytest.mark.parametrize("override", [{"adaptive": False}, {"children": "sampled"}])
def test_schedule_applies_without_adaptivity_or_to_sampled_children(override):
    """A non-adaptive request or drawn children: the schedule's tree (2, 1): 1 + 2 + 2 nodes (fewer
    when two draws name one token)."""
    assert 4.0 < mean_tree(SLOW_FLAT, **override) <= 5.0


def test_plan_carries_the_cost_to_models_only():
    names, neural = ("ssm", "suffix"), (True, False)
    plan = plan_proposers(names, neural, SpeculationOptions(max_tree_nodes=20), cost=FLAT)
    assert [a.spec.cost for a in plan] == [FLAT, None]
    assert [a.spec.max_nodes for a in plan] == [20, 20]
    by_schedule = plan_proposers(names, neural, SpeculationOptions(policy="schedule"), cost=FLAT)
    assert by_schedule[0].spec.cost is None


@pytest.mark.parametrize("options,sampling,model_nodes", [
    ({}, SamplingParams(), 20),                                             # greedy, adaptive: shaped up to the budget
    ({"adaptive": False}, SamplingParams(), 1 + 2 + 4 + 4),                 # not adaptive: the schedule's tree
    ({"children": "sampled"}, SamplingParams(temperature=0.8), 1 + 2 + 4 + 4),  # drawn children: the schedule's
    ({"children": "sampled"}, SamplingParams(), 20),                        # greedy takes top-k children anyway
])
def test_plan_reserves_the_budget_only_where_the_shape_follows_the_cost(options, sampling, model_nodes):
    """Admission reserves what the plan can draw: the budget only for a cost-aware shape, else the
    schedule's full tree (here (2, 2, 1): 11 nodes)."""
    options = SpeculationOptions(expansion=(2, 2, 1), max_tree_nodes=20, **options)
    plan = plan_proposers(("ssm", "suffix"), (True, False), options, sampling, cost=FLAT)
    assert [a.spec.max_nodes for a in plan] == [model_nodes, 20]
    assert plan[0].spec.cost_aware == (model_nodes == 20)


@pytest.mark.parametrize("mode", ["tree", "sequence"])
def test_a_one_node_budget_plans_no_drafting(mode):
    options = SpeculationOptions(mode=mode, max_tree_nodes=1)
    assert plan_proposers(("ssm", "suffix"), (True, False), options, cost=FLAT) == ()


def test_release_forgets_the_history():
    drafter = LookupDrafter(SSM_A, 0, "ssm")
    state = drafter.new_state()
    drafter.draft(state, [3, 5], DraftSpec((1,), cost=FLAT), make_generator(0, 1))
    assert drafter.shape_history(state).last is not None
    drafter.release(state)
    assert drafter._shapes == {}


# -- Greedy exactness, fp32. -----------------------------------------------------------------

LONG = tuple((7 * i + 3) % 61 + 1 for i in range(90))


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(2)
    return tiny_model("llama", 97, layers=2, seed=1), tiny_model("llama", 97, layers=1, seed=2)


@pytest.mark.parametrize("cost", [FLAT, STEEP, TreeCost(((1, 10.0), (64, 20.0)), 2, 3, 5)])
@pytest.mark.parametrize("self_draft", [False, True])
def test_greedy_cost_aware_equals_generate(models, cost, self_draft):
    target, ssm = models
    engine = SpeculativeEngine(TargetModel(target), [ModelDrafter(target if self_draft else ssm, 0, "ssm")],
                               IdTokenizer(), set(), cost=cost)
    result = engine.generate(GenerationRequest(LONG, 40))
    assert list(result.token_ids) == reference_greedy(target, list(LONG), 40)
    assert len(result.stats.tree_sizes) == result.stats.target_steps - 1
    assert engine.drafters[0]._shapes == {}  # released with the request


def test_greedy_cost_aware_paged_equals_generate(models):
    target, ssm = models
    target_pool, target_batcher = paged_parts(target, 4096)
    ssm_pool, ssm_batcher = paged_parts(ssm, 4096)
    engine = SpeculativeEngine(PagedTarget(target, target_pool, target_batcher),
                               [PagedDrafter(ssm, 0, "ssm", ssm_pool, ssm_batcher)], IdTokenizer(), set(), 1024,
                               cost=SLOW_FLAT)
    result = engine.generate(GenerationRequest(LONG, 40))
    assert list(result.token_ids) == reference_greedy(target, list(LONG), 40)
    assert max(result.stats.tree_sizes) > 4
    assert ssm_pool.counts()[0] == ssm_pool.counts()[2]  # every block back


# -- Sampled output: the target's distribution; the negative control. ------------------------


class ReleasingLookup(LookupDrafter):
    """A lookup drafter whose states are dropped after each draft (the walk makes one per step)."""

    def draft(self, state, committed, spec, generator) -> Proposal:
        try:
            return super().draft(state, committed, spec, generator)
        finally:
            self.release(state)


class RerankedSampled(ReleasingLookup):
    """NEGATIVE CONTROL: draws three *sampled* children at the root, then keeps only the most
    probable draw (re-ranking drawn children, which the cost-aware policy never does)."""

    def draft(self, state, committed, spec, generator) -> Proposal:
        drawn = super().draft(state, committed, DraftSpec((3,), "sampled", spec.sampling), generator)
        q = drawn.draws.q[0]  # [V]: every root draw came from the same q
        best = max(drawn.tree.tokens[1:].tolist(), key=lambda token: float(q[token]))
        builder = TreeBuilder(root=committed[-1], proposer=self.proposer)
        builder.add(0, best, q)
        return builder.build()


def sample(drafter: type[LookupDrafter], spec: DraftSpec, pool, length: int = 3):
    """SAMPLES walks of the full loop with a ``drafter`` over SSM_A the only proposer
    (tests/test_distribution.py)."""
    case = Walk("cost-aware", ((SSM_A, spec.children, spec.schedule),), spec.sampling, length=length)
    walks, stats = sample_walks(case, SAMPLES, 7, pool, proposers=[(functools.partial(drafter, SSM_A, 0, "ssm"), spec)])
    return chi_square(walks, prefix_distribution(TARGET.probs(spec.sampling), PROMPT, length)), summary(stats)


@pytest.mark.parametrize("sampling", [T1, SamplingParams(temperature=0.7, top_k=5, top_p=0.9)])
def test_cost_aware_sampled_output_is_target_distributed(sampling, walk_pool):
    spec = DraftSpec((1,), "top_k", sampling, max_nodes=32, cost=TreeCost(((1, 1e6), (64, 1.4e6)), 2, 3, 3))
    result, stats = sample(ReleasingLookup, spec, walk_pool)
    report("cost-aware top-k tree", result)
    assert result.pvalue > THRESHOLD
    assert stats["deep accepted"] > 0.02 * stats["steps"]  # speculation happened, below the root too


def test_reranking_sampled_children_is_rejected(walk_pool):
    result, _ = sample(RerankedSampled, DraftSpec((3,), "sampled", T1), walk_pool, length=2)
    report("NEGATIVE CONTROL re-ranked sampled children", result)
    assert result.pvalue < THRESHOLD


def test_backoff_sits_out_longer_while_trees_keep_no_nodes():
    from engine.shape import Backoff

    backoff, pattern = Backoff(limit=4), []
    for nodes in (0, 0, 0, 0, 3, 0):  # the docstring's example, then a tree with nodes, then none again
        assert backoff.drafts()
        backoff.record(nodes)
        pattern.append(backoff.left)
        for _ in range(backoff.left):
            assert not backoff.drafts()
    assert pattern == [1, 2, 4, 4, 0, 1]


def test_a_request_whose_cost_aware_trees_keep_no_nodes_decodes_plainly():
    """The session leaves the cost-aware SSM out (no draft call: plain decoding) for 1, 2, 4, 8
    steps after each drafted step whose tree was the root alone; outputs are the target's."""
    from engine.step import Drafted, Session, iterate_sync, root_only_proposal, step_outcome
    from engine.verify import Verdict

    drafted_at, steps = [], [0]

    class RootOnly:
        async def prefill(self, prompt_ids):
            return 1

        async def draft(self, committed, plan):
            assert all(a.spec.cost_aware for a in plan)
            drafted_at.append(steps[0])
            return Drafted(root_only_proposal(committed[-1]))

        async def verify(self, drafted):
            steps[0] += 1
            return step_outcome(drafted, Verdict((0,), 2, bonus=True), 1.0)

        def release(self):
            pass

    session = Session(RootOnly(), GenerationRequest((5, 6), 21), ("ssm",), (True,), IdTokenizer(), (),
                      cost=TEN_A_TOKEN)
    updates = list(iterate_sync(session.updates()))
    assert sum(len(u.token_ids) for u in updates) == 21 and steps[0] == 20
    assert drafted_at == [0, 2, 5, 10, 19]  # steps 1, 3, 6, 11, 20: sitting out 1, 2, 4, 8


@pytest.mark.parametrize("steps,carried", [  # proposer 1 is the model-free one; min_tokens 4
    ([((0, 1),) * 5], True),  # every accepted token was the suffix proposer's too
    ([((1,),) * 4], True),  # the SSMs sat out and it carried on
    ([((1,),) * 3], False),  # too few
    ([((0, 1), (0,), (0, 1), (0, 1))], False),  # token 2 was the SSM's alone
    ([((0, 1),) * 5, ((1,),)], False),  # carried, then a step that accepted one: the SSMs draft again
    ([()], False),  # nothing accepted
])
def test_model_free_lead_follows_the_last_step(steps, carried):
    lead = ModelFreeLead()
    for accepted_by in steps:
        lead.record(accepted_by, frozenset({1}))
    assert lead.carried is carried


class CountingModelDrafter(ModelDrafter):
    """Counts its drafts; its SSM forwards cost what the table says, not the clock, so its trees
    (and so the steps) are the same on any machine."""

    def __init__(self, model):
        super().__init__(model, 0, "ssm")
        self.calls, self.forward_ms = 0, {1: 1.0, 4: 2.0}

    def _time_forward(self, began: float, tokens: int) -> None:
        pass

    def draft_program(self, *args, **kwargs):  # every draft, alone or in the engine loop's batch
        self.calls += 1
        return (yield from super().draft_program(*args, **kwargs))


@pytest.mark.parametrize("lead", [True, False])
def test_the_ssm_sits_out_while_the_suffix_proposer_carries_the_steps(models, monkeypatch, lead):
    """A repeated request: the suffix proposer finds the first answer in its global store, so after
    its first carried step the SSM sits out (3 of the 7 steps here, tiny models, 40 tokens); the
    output is the target's own greedy output. Negative control (no lead): the SSM drafts every step."""
    target, ssm = models
    if not lead:
        monkeypatch.setattr("engine.step.ModelFreeLead", lambda: ModelFreeLead(min_tokens=10 ** 6))
    drafter = CountingModelDrafter(ssm)
    engine = SpeculativeEngine(TargetModel(target), [drafter, SuffixDrafter(1)], IdTokenizer(), set(), cost=FLAT,
                               draft_gate=False)  # its control iterations would skip a draft too
    first = engine.generate(GenerationRequest(LONG, 40))
    drafter.calls = 0
    second = engine.generate(GenerationRequest(LONG, 40))
    expected = reference_greedy(target, list(LONG), 40)
    assert list(first.token_ids) == list(second.token_ids) == expected
    steps = second.stats.target_steps - 1  # the prefill counts as a target step
    assert second.stats.accepted_per_proposer["suffix"] > 20
    if lead:
        assert 1 <= drafter.calls <= steps - 3
    else:
        assert drafter.calls == steps

