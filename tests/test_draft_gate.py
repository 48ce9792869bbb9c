"""The draft gate (engine.draft_gate): its pure functions, its limit stepped by hand with given
samples, and the engine loop under it (fp32 tiny models, the gate's verdicts fixed by the test, so
no clock decides anything): held-back requests decode plainly and every output stays the target's
own greedy decoding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import engine.draft_gate as draft_gate
from engine.draft_gate import (CONTROL_EVERY, MAX_SAMPLES, SAMPLES, Candidate, DraftGate, Load, Sample, bucket,
                               drafting_pays, forgone, hangs_on_price, joins, plain_ms, pooled_pays,
                               saving_per_token)
from engine.paged_models import PagedDrafter, PagedTarget, paged_parts
from engine.phases import local_loop
from engine.requests import GenerationRequest, SpeculationOptions
from engine.shape import TreeCost
from tests.test_loop import drain
from tests.tiny_models import IdTokenizer, reference_greedy, tiny_model

CURVE = TreeCost(((1, 70.0), (8, 88.0), (32, 190.0)))
PAYS, LOSES = Sample(8, 16, 16, 0, 20.0, 160.0), Sample(8, 16, 8, 0, 60.0, 170.0)


@pytest.mark.parametrize("candidate, expected", [
    (Candidate(0, 300, 64, False), True),  # 300 <= 8 x 64
    (Candidate(0, 330, 30, False), False),  # its catch-up outweighs what 30 tokens can gain
    (Candidate(0, 330, 30, True), True),  # drafted last iteration: nothing to catch up
    (Candidate(0, 0, 0, False), True),
])
def test_joins(candidate, expected):
    assert joins(candidate) is expected


@pytest.mark.parametrize("candidate, catch_up_ms, saving_ms, expected", [
    (Candidate(0, 300, 64, False), 0.9, 0.65, False),  # 270 ms of catch-up for 41.6 saved
    (Candidate(0, 300, 64, False), 0.9, 20.0, True),
    (Candidate(0, 300, 64, True), 0.9, 0.0, True),
    (Candidate(0, 300, 64, False), None, 0.65, True),  # nothing measured yet: JOIN_RATIO
])
def test_joins_once_catch_up_and_saving_are_measured(candidate, catch_up_ms, saving_ms, expected):
    assert joins(candidate, catch_up_ms, saving_ms) is expected


@pytest.mark.parametrize("loads, level, expected", [
    ({2: Load(ratio=1.5, saving_ms=2.0)}, 3, 1.13),  # the docstring's example: 8-15 from 4-7
    ({2: Load(ratio=1.5, saving_ms=2.0)}, 2, 2.0),  # its own
    ({2: Load(ratio=0.8, saving_ms=2.0)}, 2, None),  # a probe of a load that did not pay: JOIN_RATIO
    ({2: Load(ratio=0.8, saving_ms=2.0)}, 3, None),  # no paying load to go by
    ({0: Load(ratio=2.0, saving_ms=26.0), 2: Load(ratio=1.5, saving_ms=2.0)}, 3, 1.13),  # the nearest
    ({}, 3, None),
])
def test_the_saving_a_newcomer_is_weighed_against(loads, level, expected):
    saving = DraftGate(CURVE, loads=loads).saving_at(level)
    assert saving == (None if expected is None else pytest.approx(expected, abs=5e-3))


def test_at_a_load_not_yet_measured_newcomers_weigh_their_catch_up_against_the_nearest_saving():
    """8 running, never met: a request with 250 tokens to catch up (0.9 ms each) and 64 to emit does
    not start drafting on 4-7 running's 2 ms a token (1.13 here: 72 ms saved against 225 of catch-up);
    with 26 ms a token at 1 running the only verdict (x 11 / 70) it does."""
    pool = [Candidate(i, 250, 64, False) for i in range(8)]
    gate = DraftGate(CURVE, catch_up_ms=0.9, loads={2: Load(ratio=1.5, saving_ms=2.0, plain_scale=1.0)})
    assert gate.choose(pool, 8) == frozenset()
    gate = DraftGate(CURVE, catch_up_ms=0.9, loads={0: Load(ratio=2.0, saving_ms=26.0, plain_scale=1.0)})
    assert len(gate.choose(pool, 8)) == 8


def test_saving_per_token_worked_example():
    sample = Sample(8, 8, 7, 0, 43.0, 137.0)
    assert plain_ms(sample, CURVE) == pytest.approx(98.82, abs=0.01)
    assert drafting_pays(sample, CURVE) == pytest.approx(1.065, abs=1e-3)
    assert saving_per_token(sample, CURVE, 8) == pytest.approx(0.352, abs=1e-3)
    assert saving_per_token(LOSES, CURVE, 8) == 0.0


def test_a_catch_up_is_priced_against_the_steady_draft_cost():
    gate = measured_gate()
    step(gate, 8, PAYS)  # 4 new drafters: not steady, and no steady draft cost to compare with yet
    assert gate.catch_up_ms is None
    step(gate, 8, PAYS)  # steady: 20 ms over 4 drafters -> 5 ms each
    assert gate.loads[bucket(8)].draft_ms == 5.0
    gate.observe(frozenset(range(6)), Sample(8, 16, 16, 0, 130.0, 160.0, catch_up=200))  # 2 new: 100 each
    assert gate.catch_up_ms == pytest.approx((130.0 - 6 * 5.0) / 200)  # 0.5 ms a token
    gate.observe(frozenset(range(7)), Sample(8, 16, 16, 0, 120.0, 160.0, catch_up=5))  # a deep tree, not 5 tokens
    assert gate.catch_up_ms == pytest.approx(0.5)  # below MIN_CATCH_UP: not priced


def test_a_load_measures_its_plain_pass_once_a_verdict_is_close_and_then_every_so_often():
    gate, pool = DraftGate(CURVE, most=8), [Candidate(i, 2, 64, False) for i in range(8)]
    assert gate.choose(pool, 8) == frozenset(range(4))  # nothing measured: START_LIMIT, priced by the curve
    load = gate.loads[bucket(8)]
    load.ratio = 2.0  # a clear verdict: no control spent on it
    assert gate.choose(pool, 8) == frozenset(range(4))
    load.ratio = 1.1  # a close one: the next clean pass is a control
    drafting = [replace(c, drafted_last=True) for c in pool]
    assert gate.choose(drafting, 8, clean=False) == frozenset(range(4))  # prompt chunks in the pass: no control
    assert gate.choose(pool, 8) == frozenset()
    gate.observe(frozenset(), Sample(8, 0, 0, 0, 0.0, 176.0))
    assert load.plain_scale == 2.0  # the pass took 2x the curve's 88 ms
    gate.observe(frozenset(), Sample(8, 24, 3, 0, 0.0, 380.0))  # the suffix proposer's 24 tokens in it
    assert load.plain_scale == 2.0  # 380 ms is 2x the curve's 190 for 32 tokens
    chosen = [gate.choose(pool, 8) for _ in range(CONTROL_EVERY + 2)]
    assert [len(c) for c in chosen] == [4] * CONTROL_EVERY + [0, 4]
    load.ratio = 2.0  # a clear verdict: controls 4x rarer
    assert load.control_every == 4 * CONTROL_EVERY
    sample = Sample(8, 8, 4, 0, 40.0, 300.0)  # measured plain 176 ms, not the curve-scaled 216
    assert plain_ms(sample, CURVE, 2.0) == 176.0 and plain_ms(sample, CURVE) == pytest.approx(216.4, abs=0.1)


def test_drafting_pays_worked_example():
    assert forgone(LOSES, CURVE) == pytest.approx(11.19, abs=0.01)
    assert drafting_pays(LOSES, CURVE) == pytest.approx(0.715, abs=1e-3)
    assert drafting_pays(PAYS, CURVE) > 1.0


@pytest.mark.parametrize("samples, expected", [
    ([(1, 0.5), (0, 1.5), (4, 1.0)], 5 / 3),  # the docstring's example: not the mean of 2, 0 and 4
    ([(3, 2.0)], 1.5),
    ([(2, -1.0), (1, 0.5)], float("inf")),  # the pass took less than its plain price: free tokens
    ([(0, -1.0)], 0.0),
    ([(0, 2.0), (0, 1.0)], 0.0),
])
def test_pooled_pays(samples, expected):
    assert pooled_pays(samples) == pytest.approx(expected)


def one_running(drafted: int, accepted: float, forgone_tokens: float) -> Sample:
    """A steady iteration of one decoding request that forgoes ``forgone_tokens`` plain tokens at a
    plain scale of 1.0 (its plain pass: the curve's 70 ms for 1 token)."""
    return Sample(1, drafted, accepted, 0, 70.0 * forgone_tokens, 70.0)


def decide(load: Load, sample: Sample, bound: bool = False) -> None:
    load.decide(sample, CURVE, bound=bound, most=8, max_wait=32)


def test_a_verdict_waits_for_enough_drafted_tokens():
    """One request's iterations draft a few tokens each: the verdict pools them until MIN_DRAFTED
    (at most MAX_SAMPLES iterations), so one unlucky iteration does not close the load."""
    load = Load(plain_scale=1.0)
    for sample in [(4, 0, 1.0), (4, 1, 1.0), (4, 3, 1.0)]:  # the first two alone would give 0.5
        decide(load, one_running(*sample))
        assert load.ratio is None
    decide(load, one_running(5, 2, 1.0))
    assert load.ratio == pytest.approx(1.5) and load.samples == []
    for _ in range(MAX_SAMPLES):  # nothing drafted, little spent: a verdict after MAX_SAMPLES all the same
        decide(load, one_running(0, 0, 0.25))
    assert load.ratio == 0.0 and load.left == 1
    load.left = 0
    for _ in range(2):  # drafting that keeps no node at a dear load: judged as soon as it cost MIN_FORGONE
        decide(load, one_running(0, 0, 2.0))
    assert load.ratio == 0.0 and load.left == 4  # the second loss in a row: SIT_OUT_GROWTH x the first


@pytest.mark.parametrize("accepted, verify_ms, expected", [
    (4, 100.0, False),  # the docstring's example: 2.0, and 1.29 / 3.67 with the plain pass 10% cheaper / dearer
    (2, 100.0, True),  # 1.0: 0.64 / 1.83
    (0, 100.0, False),  # nothing accepted: 0 at any price
    (4, 70.0, True),  # 80 ms in all, under the dearer price (96.8 ms): the drafting looks free
])
def test_hangs_on_price(accepted, verify_ms, expected):
    sample = Sample(8, 8, accepted, 0, 10.0, verify_ms)
    assert hangs_on_price([sample], CURVE, 1.0) is expected
    assert hangs_on_price([sample, sample], CURVE, 1.0) is expected  # pooled: the same ratio


def test_a_verdict_that_hangs_on_the_plain_price_waits_for_a_control_and_is_priced_by_it():
    """8 running, the plain pass last measured at 1.3x the curve (114.4 ms), but the passes now run
    at the curve's 88 ms: two drafting iterations of 8 drafted, 1 accepted, 100 ms each look free at
    the stale price: no verdict, the next clean iteration is a control; it measures 88 ms (the
    price fades to 1.15x: 101.2 ms) and the next steady iteration's verdict prices all three at it:
    3 x 1 / (3 x 8.8 x 8 / 101.2) = 1.44 (at the stale price: inf; at 88 ms it would be 0.5). Half
    the old price stays, but from then on each close verdict comes with a control of its own."""
    gate = DraftGate(CURVE, most=8, loads={bucket(8): Load(limit=8, plain_scale=1.3, ratio=1.5)})
    drafting, load = [Candidate(i, 0, 64, True) for i in range(8)], gate.loads[bucket(8)]
    gate.drafters = frozenset(range(8))
    for _ in range(2):
        assert gate.choose(drafting, 8) == frozenset(range(8))
        gate.observe(frozenset(range(8)), Sample(8, 8, 1, 0, 10.0, 100.0))
    assert len(load.samples) == 2 and load.awaits_price and load.control_due and load.ratio == 1.5
    assert gate.choose(drafting, 8) == frozenset()  # the control
    gate.observe(frozenset(), Sample(8, 0, 0, 0, 0.0, 88.0))
    assert load.plain_scale == pytest.approx(1.15) and not load.control_due and load.priced_after
    assert gate.choose(drafting, 8) == frozenset(range(8))
    gate.observe(frozenset(range(8)), Sample(8, 8, 1, 0, 10.0, 100.0))
    assert load.ratio == pytest.approx(3 / (3 * 8.8 * 8 / 101.2)) and load.samples == []
    assert not load.awaits_price and not load.priced_after


def test_a_verdict_waits_for_a_plain_price_at_most_twice_max_samples():
    load = Load(plain_scale=1.0)
    hanging = Sample(8, 8, 2, 0, 10.0, 100.0)  # 1.0 at the price, 0.64 / 1.83 at 10% either way
    decide(load, hanging)  # one sample: no verdict yet (SAMPLES)
    for _ in range(2 * MAX_SAMPLES - 2):
        decide(load, hanging)
        assert load.ratio is None and load.awaits_price
    decide(load, hanging)
    assert load.ratio == pytest.approx(1.0) and not load.awaits_price


@given(st.integers(1, 32), st.integers(0, 64), st.floats(1.0, 500.0), st.floats(1.0, 500.0))
def test_a_draft_that_accepted_nothing_never_pays(decoding, drafted, draft_ms, verify_ms):
    sample = Sample(decoding, drafted, 0, 0, draft_ms, verify_ms)
    assert drafting_pays(sample, CURVE) == 0.0


@given(st.integers(1, 32), st.integers(1, 32), st.integers(1, 32))
def test_more_accepted_tokens_pay_more(decoding, drafted, accepted):
    def pays(a):
        return drafting_pays(Sample(decoding, drafted, a, 0, 50.0, 150.0), CURVE)
    assert pays(accepted + 1) > pays(accepted)


@pytest.mark.parametrize("running, expected", [(0, 0), (1, 0), (2, 1), (3, 2), (5, 2), (6, 3), (7, 3), (8, 3),
                                               (11, 3), (12, 4), (22, 4), (23, 5), (32, 5)])
def test_bucket(running, expected):
    assert bucket(running) == expected


def candidates(count: int, drafted: frozenset = frozenset()) -> list[Candidate]:
    return [Candidate(i, 10 * (count - i), 64, i in drafted) for i in range(count)]


def step(gate: DraftGate, running: int, sample: Sample) -> frozenset:
    """One iteration: the gate chooses among ``running`` candidates, then sees ``sample`` (with the
    catch-up of the drafters new this iteration: 10 tokens or more each, so not steady)."""
    pool = candidates(running, gate.drafters)
    chosen = gate.choose(pool, running)
    catch_up = sum(c.lag for c in pool if c.request_id in chosen and not c.drafted_last)
    gate.observe(chosen, replace(sample, catch_up=catch_up))
    return chosen


def measured_gate(most: int = 8, max_wait: int = 32) -> DraftGate:
    """A gate whose every load has measured its plain pass (at the curve's cost): no controls due."""
    return DraftGate(CURVE, most=most, max_wait=max_wait, loads={b: Load(plain_scale=1.0) for b in range(6)})


def test_who_drafts_first_those_that_drafted_last_then_the_least_lag():
    gate = measured_gate()
    gate.loads[bucket(5)] = Load(limit=2, plain_scale=1.0)
    pool = [Candidate(0, 50, 64, False), Candidate(1, 5, 64, True), Candidate(2, 9, 64, False),
            Candidate(3, 1, 64, False), Candidate(4, 900, 10, False)]
    assert gate.choose(pool, 5) == {1, 3}
    gate.loads[bucket(5)].limit = 8
    assert gate.choose(pool, 5) == {0, 1, 2, 3}  # 4 would catch up 900 tokens for 10 at most


def test_paying_doubles_the_limit_up_to_the_batch_limit():
    gate = measured_gate()
    limits = []
    for _ in range(12):
        step(gate, 8, PAYS)
        limits.append(gate.limit)
    # the first iteration and each one after a growth feed the newcomers' context: not measured
    assert limits == [4, 4, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]


def test_losing_halves_the_limit_down_to_a_probe_then_sits_out_ever_longer():
    gate = measured_gate()
    gate.loads[bucket(8)].limit = 8
    chosen = [len(step(gate, 8, LOSES)) for _ in range(32)]
    # 8 draft (1 unmeasured: 4 new, + 2 measured), then 4 of them (2 measured): the probe's size, so
    # it sits out 1; then a probe (1 unmeasured: new after the sit-out, + 2 measured) by the one
    # request with at most PROBE_LAG tokens to catch up (lag 10; the others lack 20-80), sit out 4,
    # the same probe, sit out 16, ...
    assert chosen == [8, 8, 8, 4, 4, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1] + [0] * 16
    assert gate.loads[bucket(8)].wait == 16


def test_only_a_clear_verdict_that_drafting_pays_starts_the_sit_outs_over():
    """Lose twice (sit out 1, then 4), pay by a close 1.1 (the limit doubles), lose twice (the limit
    halves, then a sit-out of 16, not 1); a clear 2.0 starts them over."""
    load, waits = Load(plain_scale=1.0), []

    def verdict(ratio: float) -> None:
        assert SAMPLES == 2
        decide(load, one_running(16, ratio * 10, 10.0), bound=True)
        load.priced(1.0)  # a control after the first sample (1.1 hangs on the plain price)
        decide(load, one_running(16, ratio * 10, 10.0), bound=True)
        assert load.ratio == pytest.approx(ratio)
        waits.append(load.wait)
    for ratio in (0.5, 0.5, 1.1, 0.5, 0.5, 2.0):
        verdict(ratio)
    assert waits == [1, 4, 4, 4, 16, 0]


def test_each_load_keeps_its_own_state_and_a_new_one_starts_from_the_nearest_verdict():
    gate = measured_gate()
    for _ in range(3):
        step(gate, 8, LOSES)  # 4 draft; two steady samples of 0.72 at the probe's size: sit out
    assert gate.loads[bucket(8)].ratio == pytest.approx(0.62, abs=1e-3) and gate.limit == 0  # plain 88 ms
    assert step(gate, 16, LOSES) == frozenset()  # first met: 0.62 nearest, closed without a probe
    assert gate.loads[bucket(16)].wait == 8  # max_wait / 4
    assert len(step(gate, 2, PAYS)) == 0  # 2-3 running: the nearest verdict (8 running) is 0.62
    gate.loads[bucket(4)] = Load(ratio=2.0, plain_scale=1.0)
    assert len(step(gate, 1, PAYS)) == 1  # 1 running: 2-3 has no verdict yet, 4-7 (2.0) is nearest: open
    assert gate.loads[bucket(1)].limit == 8
    fresh = measured_gate()
    assert len(step(fresh, 16, LOSES)) == 4  # no verdict anywhere: a probe of START_LIMIT


# -- The loop under the gate. -------------------------------------------------------------------

VOCAB = 97
SLOW_FLAT = TreeCost(((1, 1e6), (64, 1e6)))  # big trees pay in every shape decision
PROMPTS = [tuple(range(3, 9)), tuple(range(30, 50)), tuple(range(60, 64)), (7, 3, 9, 1, 40)]


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(2)
    return tiny_model("llama", VOCAB, layers=2, seed=0), tiny_model("llama", VOCAB, layers=1, seed=1)


def gated_loop(models, window: int | None = None):
    target, ssm = models
    target_pool, target_batcher = paged_parts(target, 4096, 16)
    ssm_pool, ssm_batcher = paged_parts(ssm, 4096, 16)
    drafter = PagedDrafter(ssm, 0, "ssm", ssm_pool, ssm_batcher)
    drafter.context_tokens = window
    return local_loop(PagedTarget(target, target_pool, target_batcher), [drafter], IdTokenizer(), (), cost=SLOW_FLAT)


@pytest.mark.parametrize("verdict", [0.0, float("inf")])
def test_the_loop_drafts_as_many_as_the_gate_allows_and_stays_exact(models, monkeypatch, verdict):
    """Four requests, prefilled together (whole prompts), decode together to the end; the gate starts
    at 2 drafters. Drafting never pays: 2 draft, then none while it sits out, but for probes. It
    always pays: all 4 draft and the limit grows to the batch limit."""
    monkeypatch.setattr(draft_gate, "pooled_pays", lambda samples: verdict)
    loop, seen = gated_loop(models), []
    loop.gate.loads = {bucket(4): Load(limit=2, plain_scale=1.0)}
    loop.observers.append(seen.append)
    options = SpeculationOptions(policy="cost")
    ids = [loop.submit(GenerationRequest(p, 24, speculation=options)) for p in PROMPTS]
    outputs = drain(loop, ids)
    assert [outputs[i] for i in ids] == [reference_greedy(models[0], list(p), 24) for p in PROMPTS]
    decoding = [s for s in seen if s.running == 4 and not s.prefilling]
    if verdict:
        assert max(s.drafts for s in decoding) == 4 and seen[-1].draft_limit == 8
    else:  # 2 draft until the first verdict, then the gate sits out, probing with those that lag little
        assert max(s.drafts for s in decoding[:4]) == 2 and 0 in {s.drafts for s in decoding[4:]}
        assert decoding[-1].draft_limit == 0


@pytest.mark.parametrize("window, first", [
    (None, 21),  # the whole context: a 20-token prompt and its first token
    (4, 4),  # ssms[].context_tokens: the first draft takes in 4 tokens, not 21
    (64, 21),  # a window wider than the context takes all of it
])
def test_the_gate_weighs_a_first_draft_by_what_the_ssm_takes_in(models, window, first):
    """A request's lag, as the gate gets it: before its first draft what the SSM's window feeds it;
    after that draft (the only one allowed), the tokens committed since. The loop reads the window
    from its executor (``Executor.windows``)."""
    loop, seen = gated_loop(models, window), []

    def spy(candidates, running, clean=True):
        if not candidates:  # the prompt's pass
            return frozenset()
        seen.append((candidates[0].lag, len(loop.requests[candidates[0].request_id].session.committed)))
        return frozenset({candidates[0].request_id} if len(seen) == 1 else ())
    loop.gate.choose = spy
    request = loop.submit(GenerationRequest(tuple(range(30, 50)), 12, speculation=SpeculationOptions(policy="cost")))
    drain(loop, [request])
    assert seen[0] == (first, 21) and len(seen) >= 2
    assert all(lag == committed - 21 for lag, committed in seen[1:]), seen


@pytest.mark.parametrize("saving_ms, catch_up_ms, expected", [
    (None, 0.9, {7}),  # never paid: only the request that lags 10 (<= PROBE_LAG) probes
    (0.0, 0.9, {7}),
    (0.3, 0.9, {6, 7}),  # 64 x 0.3 = 19.2 ms saved repays lag 20 (18 ms), not 30 (27 ms)
    (26.0, 0.9, {4, 5, 6, 7}),  # a lone request's saving at 1 running repays any of them: the least lag
    (26.0, None, {7}),  # no catch-up measured yet
])
def test_who_probes_a_load_that_did_not_pay(saving_ms, catch_up_ms, expected):
    gate = DraftGate(CURVE, catch_up_ms=catch_up_ms, loads={bucket(8): Load(ratio=0.9, saving_ms=saving_ms,
                                                                             plain_scale=1.0)})
    assert gate.choose(candidates(8), 8) == frozenset(expected)


@pytest.mark.parametrize("ratio, drafters, clean", [
    (None, set(), set(range(8))),  # no verdict yet: not in a busy pass; in a clean one all may start
    (0.9, set(), {1, 2, 5, 7}),  # did not pay: a clean pass probes with who drafted last and lag 10
    (1.2, {1, 2, 5}, set(range(8))),
])
def test_a_pass_with_prompt_chunks_drafts_only_where_drafting_pays_and_only_who_drafted_last(ratio, drafters,
                                                                                             clean):
    """A probe in a pass busy with prompts could not be measured: only a paying load drafts there,
    and only with the requests that drafted in the iteration before (1, 2, 5: no catch-up). In a
    clean pass a load that did not pay probes with those and the requests that lag at most PROBE_LAG
    (7: lag 10 of 10-80); a paying one lets the others join too."""
    gate = measured_gate()
    gate.loads[bucket(8)] = Load(limit=8, ratio=ratio, plain_scale=1.0)
    pool = candidates(8, frozenset({1, 2, 5}))
    assert gate.choose(pool, 8, clean=False) == frozenset(drafters)
    assert gate.choose(pool, 8) == frozenset(clean)


def test_a_pass_with_prompt_chunks_gives_no_verdict():
    """A pass busy with prompts makes a few drafted tokens look cheap: only clean passes count."""
    gate, busy = measured_gate(), replace(PAYS, prompt=256)
    for sample in (busy, busy, busy):
        step(gate, 8, sample)
    assert gate.loads[bucket(8)].ratio is None and gate.limit == 4
    for sample in (PAYS, PAYS):
        step(gate, 8, sample)
    assert gate.loads[bucket(8)].ratio is not None and gate.limit == 8
