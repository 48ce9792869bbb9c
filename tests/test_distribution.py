"""Lossless stochastic verification, proven by distribution tests (issue 3).

1. Lookup-table level: exact second-order "models" (tests/lookup_models.py), trees drafted by the
   real ModelDrafter loop, merged and verified by the engine, the full loop simulated until the
   output prefix is complete; chi-square against the exact target distribution of the prefix.
2. A negative control (a deliberately biased verifier) that the same test must reject.
3. End to end through SpeculativeEngine with tiny random Llamas.
4. The rule exactly: by enumeration over the drafting, the emitted token is p-distributed and
   MSS rejects no more often than naive sampling (SpecInfer Theorem 4.3); on fixed trees the
   engine's verifier matches the rule's exact (non-p) distribution, which catches slips that
   average out over the drafting (a dropped duplicate draw moves p by only ~0.004 in TV).
5. Seeded reproducibility; 6. the `specinfer generate` sampling flags.

Every chi-square test uses fixed seeds, so it is deterministic; the statistics are printed
(``pytest -s``) as lines starting with ``chi2``.
"""

from __future__ import annotations

import copy
import functools
import itertools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.suffix import SuffixDrafter
from engine.draft import DraftSpec, ModelDrafter, Proposal, TreeBuilder
from engine.requests import GenerationRequest, SpeculationOptions
from engine.generate import SpeculativeEngine
from engine.merge import merge
from engine.sampling import SamplingParams, make_generator
from engine.target import TargetModel
from engine.tree import children
from engine.verify import Verdict, verify_stochastic
from settings.config import SuffixConfig
from tests.lookup_models import (LookupDrafter, LookupLM, accept_first_draws, chi_square, node_contexts,
                                 prefix_distribution, save_tiny_pair, target_first_two, tiny_llama,
                                 tiny_tokenizer)

THRESHOLD = 1e-3  # chi-square p-value: above it the output is the target distribution
SAMPLES = 20_000  # per lookup-level case
E2E_SAMPLES = 2_000  # per end-to-end case
VOCAB = 12
PROMPT = (3, 5)  # the lookup models see the last two tokens
SUFFIX_PROMPT = (3, 5, 9, 3, 5)  # the suffix proposer finds [3, 5] -> 9, 3

TARGET = LookupLM(VOCAB, seed=1, scale=1.5)
SSM_A = LookupLM(VOCAB, seed=2, base=TARGET, mix=0.6, temperature=1.5)  # correlated with p, flatter
SSM_B = LookupLM(VOCAB, seed=2, base=TARGET, mix=0.6, temperature=0.6)  # A's ranking, sharper: other q
SSM_C = LookupLM(VOCAB, seed=3, base=TARGET, mix=0.3)  # a weaker, different SSM

T1 = SamplingParams(temperature=1.0)
WARPED = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
TOP5 = SamplingParams(temperature=1.0, top_k=5)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def report(name: str, result) -> None:
    print(f"\nchi2 {name}: statistic {result.statistic:.2f}, cells {result.cells} "
          f"(pooled {result.pooled}), samples {result.samples}, p-value {result.pvalue:.4g}")


# ---------------------------------------------------------------------------------------------
# Verifiers besides the engine's: naive sampling, and the biased negative control.


def verify_naive(proposal, target_probs: torch.Tensor, generator) -> Verdict:  # target_probs [N, V]
    """Naive sampling (SpecInfer NS): draw x ~ p at the node; descend if x is a child, else stop."""
    kids, tokens = children(proposal.tree.parents), proposal.tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        token = int(torch.multinomial(target_probs[node].float(), 1, generator=generator))
        match = next((c for c in kids[node] if tokens[c] == token), None)
        if match is None:
            return Verdict(tuple(path), token, bonus=not kids[node])
        node = match
        path.append(node)


def verify_biased(proposal, target_probs: torch.Tensor, draft_probs: torch.Tensor, generator) -> Verdict:
    """NEGATIVE CONTROL, deliberately wrong: deterministic (top-k) children verified with the MSS
    ratio min(1, r(x) / q(x)) and residual max(0, r - q), q the SSM's softmax at the parent, as
    if the children had been sampled from q. target_probs, draft_probs: # [N, V]."""
    kids, tokens = children(proposal.tree.parents), proposal.tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        residual, q = target_probs[node].double(), draft_probs[node].double()
        accepted = None
        for child in kids[node]:
            coin = float(torch.rand((), generator=generator, dtype=torch.float64))
            if coin < min(1.0, float(residual[tokens[child]] / q[tokens[child]])):
                accepted = child
                break
            residual = (residual - q).clamp(min=0.0)
            residual = residual / residual.sum()
        if accepted is None:
            token = int(torch.multinomial(residual.float(), 1, generator=generator))
            return Verdict(tuple(path), token, bonus=not kids[node])
        node = accepted
        path.append(node)


VERIFIERS = {
    "mss": lambda proposal, p, q, generator: verify_stochastic(proposal, p, generator),
    "ns": lambda proposal, p, q, generator: verify_naive(proposal, p, generator),
    "biased": verify_biased,
}


# ---------------------------------------------------------------------------------------------
# 1 and 2. The full loop at the lookup-table level.


@dataclass(frozen=True)
class Walk:
    """A lookup-level configuration of draft -> merge -> verify -> commit."""

    name: str
    ssms: tuple[tuple[LookupLM, str, tuple[int, ...]], ...]  # (model, children rule, expansion schedule)
    sampling: SamplingParams = T1
    length: int = 3  # output prefix whose distribution is tested
    suffix: bool = False  # the suffix proposer too, its global store on (bounded)
    verifier: str = "mss"
    prompt: tuple[int, ...] = PROMPT
    min_confidence: float = 0.0  # > 0: dynamic tree, only confident nodes are expanded


# The walks are pure Python on one torch thread: they run in this many processes (the in-process
# tests run before Ray starts, so the second core is otherwise idle). Each chunk has its own random
# streams (the generators' position is the chunk), so the sample is the same whatever the scheduling.
CHUNKS = 2


@pytest.fixture(scope="module")
def walk_pool() -> Iterator[ProcessPoolExecutor]:
    """Processes for the chunks after the first (the test's own process walks the first), each on one
    torch thread, as the test's own process is (``one_torch_thread``)."""
    with ProcessPoolExecutor(CHUNKS - 1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=torch.set_num_threads, initargs=(1,)) as pool:
        yield pool


def sample_walks(case: Walk, samples: int, seed: int, pool: ProcessPoolExecutor,
                 proposers: list | None = None) -> tuple[list[tuple[int, ...]], Counter]:
    """``samples`` output prefixes of one configuration, with counters of what verification did:
    ``CHUNKS`` chunks of walks, all but the first in ``pool``, concatenated in chunk order.
    ``proposers``: (drafter factory, DraftSpec) pairs that draft in place of the case's SSMs (each chunk
    makes its own drafters: a factory pickles, a drafter need not)."""
    sizes = [samples // CHUNKS + (chunk < samples % CHUNKS) for chunk in range(CHUNKS)]
    futures = [pool.submit(walk_chunk, case, sizes[chunk], seed, chunk, proposers) for chunk in range(1, CHUNKS)]
    parts = [walk_chunk(case, sizes[0], seed, 0, proposers)] + [future.result() for future in futures]
    return [s for part, _ in parts for s in part], sum((stats for _, stats in parts), Counter())


def walk_chunk(case: Walk, samples: int, seed: int, chunk: int,
               proposers: list | None = None) -> tuple[list[tuple[int, ...]], Counter]:
    """One chunk of ``sample_walks``: its random streams are (seed, stream, position = chunk)."""
    dynamic = {"min_confidence": case.min_confidence} if case.min_confidence else {}
    if proposers is None:
        proposers = [(functools.partial(LookupDrafter, lm, i, f"ssm{i}"),
                      DraftSpec(schedule, rule, case.sampling, **dynamic))
                     for i, (lm, rule, schedule) in enumerate(case.ssms)]
    drafters = [(make(), spec, make_generator(seed, i + 1, chunk)) for i, (make, spec) in enumerate(proposers)]
    if case.suffix:
        suffix = SuffixDrafter(len(drafters), SuffixConfig(max_cached_requests=16, min_token_prob=0.0))
        drafters.append((suffix, DraftSpec((1,), "top_k", case.sampling, max_nodes=6), None))
    p_table, q_table = TARGET.probs(case.sampling), case.ssms[0][0].probs(case.sampling)
    generator, stats = make_generator(seed, 0, chunk), Counter()
    return [walk(case, drafters, p_table, q_table, generator, stats) for _ in range(samples)], stats


def walk(case: Walk, drafters, p_table, q_table, generator, stats: Counter) -> tuple[int, ...]:
    """One request, as SpeculativeEngine runs it, until ``case.length`` tokens are out.

    p_table, q_table: # [V, V, V] the target's and first SSM's warped distributions. A single
    proposal skips merge (it would only renumber the nodes; the merged cases test merge), which
    keeps 20,000 samples per case affordable."""
    committed, out = list(case.prompt), []
    states = [d.new_state() for d, _, _ in drafters]  # one request: the suffix proposer follows it
    while len(out) < case.length:
        proposals = [d.draft(state, committed, spec, g) for (d, spec, g), state in zip(drafters, states)]
        proposal = merge(proposals) if len(proposals) > 1 else proposals[0]
        prev, last = node_contexts(proposal.tree, committed)
        verdict = VERIFIERS[case.verifier](proposal, p_table[prev, last], q_table[prev, last], generator)
        new = proposal.tree.tokens[list(verdict.path[1:])].tolist() + [verdict.next_token]
        stats[len(verdict.path) - 1, verdict.bonus] += 1
        committed += new
        out += new
    for (d, _, _), state in zip(drafters, states):
        d.release(state)
    return tuple(out[: case.length])


def summary(stats: Counter) -> dict[str, int]:
    """Steps; steps that accepted >= 1 / >= 2 draft tokens; steps ending in a bonus token."""
    return {
        "steps": sum(stats.values()),
        "root accepted": sum(n for (accepted, _), n in stats.items() if accepted >= 1),
        "deep accepted": sum(n for (accepted, _), n in stats.items() if accepted >= 2),
        "bonus": sum(n for (_, bonus), n in stats.items() if bonus),
    }


def shared_draws(proposal) -> tuple[int, int]:
    """(nodes named by several proposers, (node, proposer) pairs drawn more than once)."""
    draws = Counter(zip(proposal.draws.node.tolist(), proposal.draws.proposer.tolist()))
    per_node = Counter(node for node, _ in draws)
    return sum(n > 1 for n in per_node.values()), sum(n > 1 for n in draws.values())


MERGED_DUPLICATES = Walk("merged 2 SSMs sampled, duplicates, T 0.7",
                         ((SSM_A, "sampled", (2, 1)), (SSM_B, "sampled", (2, 1))), SamplingParams(0.7), length=2)
WALKS = [
    # name, proposers (model, children rule, schedule), sampling, output prefix length, ...
    Walk("sampled (2,2,1)", ((SSM_A, "sampled", (2, 2, 1)),)),
    Walk("sampled_without_replacement (3,1), top_k 5", ((SSM_A, "sampled_without_replacement", (3, 1)),), TOP5,
         length=2),
    Walk("top_k children (2,2) (NS rule), top_p 0.9", ((SSM_A, "top_k", (2, 2)),),
         SamplingParams(temperature=1.0, top_p=0.9)),
    MERGED_DUPLICATES,
    Walk("merged sampled + top_k + suffix", ((SSM_B, "sampled", (2, 1)), (SSM_C, "top_k", (2, 1))), length=2,
         suffix=True, prompt=SUFFIX_PROMPT),
    Walk("dynamic tree (3,2), min_confidence 0.15", ((SSM_A, "sampled", (3, 2)),), length=2, min_confidence=0.15),
    Walk("sequence mode: chain (1,1,1)", ((SSM_A, "sampled", (1, 1, 1)),)),
    Walk("naive sampling verifier", ((SSM_A, "sampled", (2, 1)),), length=2, verifier="ns"),
    Walk("T 0.7, top_k 5, top_p 0.9", ((SSM_A, "sampled", (2, 1)),), WARPED, length=2),
]


BIASED = Walk("NEGATIVE CONTROL biased top_k + MSS ratio", ((SSM_A, "top_k", (2, 2)),), verifier="biased")


@pytest.mark.parametrize("case", WALKS, ids=[c.name for c in WALKS])
def test_lookup_output_is_target_distributed(case: Walk, walk_pool):
    samples, stats = sample_walks(case, SAMPLES, seed=7, pool=walk_pool)
    result = chi_square(samples, prefix_distribution(TARGET.probs(case.sampling), case.prompt, case.length))
    report(case.name, result)
    stats = summary(stats)
    print(f"     {stats}")
    assert result.pvalue > THRESHOLD
    # The test has teeth only if speculation happened: drafts accepted, also below the root.
    assert stats["root accepted"] > 0.2 * stats["steps"]
    assert stats["bonus"] > 0
    if max(len(s) for _, _, s in case.ssms) > 1:
        assert stats["deep accepted"] > 0.02 * stats["steps"]


def test_merged_case_has_shared_and_duplicate_draws():
    """The duplicate-proposal case really gives one token two draws with different q's, and
    one SSM drawing a token twice."""
    case = MERGED_DUPLICATES
    drafters = [(LookupDrafter(lm, i, f"ssm{i}"), DraftSpec(schedule, rule, case.sampling), make_generator(0, i))
                for i, (lm, rule, schedule) in enumerate(case.ssms)]
    proposals = [merge([d.draft(d.new_state(), list(PROMPT), spec, g) for d, spec, g in drafters])
                 for _ in range(200)]
    shared, repeated = np.sum([shared_draws(p) for p in proposals], axis=0)
    assert shared > 100 and repeated > 20
    draws = proposals[0].draws
    assert not torch.equal(draws.q[draws.proposer == 0][0], draws.q[draws.proposer == 1][0])


def test_dynamic_case_prunes_the_tree():
    """The dynamic-tree case really drafts smaller trees than the same static schedule."""
    def mean_size(**dynamic) -> float:
        spec, generator = DraftSpec((3, 2), "sampled", T1, **dynamic), make_generator(0, 1)
        drafter = LookupDrafter(SSM_A, 0, "ssm0")
        trees = [drafter.draft(drafter.new_state(), list(PROMPT), spec, generator).tree for _ in range(200)]
        return np.mean([tree.size for tree in trees])

    assert mean_size(min_confidence=0.15) < 0.8 * mean_size()


def test_biased_verifier_is_rejected(walk_pool):
    """Negative control: the same chi-square test has the power to reject a biased verifier."""
    case = BIASED
    samples, _ = sample_walks(case, SAMPLES, seed=7, pool=walk_pool)
    result = chi_square(samples, prefix_distribution(TARGET.probs(case.sampling), case.prompt, case.length))
    report(case.name, result)
    assert result.pvalue < THRESHOLD


# ---------------------------------------------------------------------------------------------
# 4. The verification rule, exactly: lossless by enumeration, followed by the engine on fixed
#    trees, and SpecInfer Theorem 4.3: P(reject | MSS) <= P(reject | NS) on the same trees.


def mss_node(p: np.ndarray, draws) -> tuple[np.ndarray, float]:
    """Exact distribution of the token verification emits at a node (the accepted child's token,
    or the recovered token), and the probability that every draw is rejected.

    p: # [V] the target's distribution at the node; draws: [(token, q # [V], or None if
    deterministic)] in draw order. The documented rule of engine.verify, in expectation over coins.
    """
    out, residual, rejected = np.zeros_like(p), p.copy(), 1.0
    for token, q in draws:
        if q is None:
            accept, left = residual[token], np.where(np.arange(len(p)) == token, 0.0, residual)
        else:
            accept, left = min(1.0, residual[token] / q[token]), np.maximum(residual - q, 0.0)
        out[token] += rejected * accept
        rejected *= 1.0 - accept
        if rejected <= 0.0 or left.sum() <= 0.0:  # the second only by rounding, when p ~= q
            return out, 0.0
        residual = left / left.sum()
    return out + rejected * residual, rejected


def draw_sequences(q: np.ndarray, logits: np.ndarray, rule: str, k: int):
    """Every possible draw list of one proposer at a node, with its probability (as choose_children).

    q: # [V] the warped draft distribution; logits: # [V] its raw logits (top_k ranks these).
    "top_k_as_sampled" is the biased negative control: top-k tokens passed off as drawn from q."""
    if rule in ("top_k", "top_k_as_sampled"):
        top = np.argsort(-logits, kind="stable")[:k]
        yield [(int(t), None if rule == "top_k" else q) for t in top], 1.0
    elif rule == "sampled":
        for tokens in itertools.product(np.flatnonzero(q), repeat=k):
            yield [(int(t), q) for t in tokens], float(np.prod(q[list(tokens)]))
    else:
        yield from _without_replacement(q, min(k, int((q > 0).sum())), [], 1.0)


def _without_replacement(q: np.ndarray, k: int, prefix: list, weight: float):
    if len(prefix) == k:
        yield prefix, weight
        return
    for token in np.flatnonzero(q):
        rest = q.copy()
        rest[token] = 0.0
        yield from _without_replacement(rest / rest.sum() if rest.sum() > 0 else rest, k,
                                        prefix + [(int(token), q)], weight * q[token])


def first_draw_per_token(draws):
    """A wrong merge that keeps one draw per token (the negative control of the exact check)."""
    seen: set[int] = set()
    return [(t, q) for t, q in draws if not (t in seen or seen.add(t))]


def exact_root(p: np.ndarray, proposers, edit=None) -> tuple[np.ndarray, float, float]:
    """(output distribution # [V], MSS rejection, NS rejection) at a node, over the drafting.

    proposers: [(q # [V], logits # [V], rule, k)]; draws are tried in proposer order, as merge
    concatenates them; ``edit`` alters each draw list. NS rejects when x ~ p is no child."""
    out, mss, ns = np.zeros_like(p), 0.0, 0.0
    for combination in itertools.product(*(list(draw_sequences(*proposer)) for proposer in proposers)):
        draws = [draw for sequence, _ in combination for draw in sequence]
        weight = float(np.prod([w for _, w in combination]))
        emitted, rejected = mss_node(p, edit(draws) if edit else draws)
        out, mss = out + weight * emitted, mss + weight * rejected
        ns += weight * (1.0 - p[sorted({token for token, _ in draws})].sum())
    return out, mss, ns


THEOREM_CASES = [
    # name, proposers (model, children rule, width at the root), sampling
    ("sampled k=1 (classical)", ((SSM_A, "sampled", 1),), T1),
    ("sampled k=3", ((SSM_A, "sampled", 3),), T1),
    ("without replacement k=3", ((SSM_A, "sampled_without_replacement", 3),), T1),
    ("merged sampled 2 + 2", ((SSM_A, "sampled", 2), (SSM_B, "sampled", 2)), T1),
    ("merged sampled 2 + top_k 1", ((SSM_A, "sampled", 2), (SSM_C, "top_k", 1)), T1),
    ("top_k k=2 (MSS is NS)", ((SSM_A, "top_k", 2),), T1),
    ("sampled k=2, T 0.7 top_k 5 top_p 0.9", ((SSM_A, "sampled", 2),), WARPED),
]
CONTEXTS = [PROMPT, (0, 1), (7, 7), (11, 4)]
TREES = 2_000  # sampled trees per case for the measured rates


def root_args(proposers, sampling: SamplingParams, context) -> list:
    return [(lm.probs(sampling).numpy()[context], lm.table.double().numpy()[context], rule, k)
            for lm, rule, k in proposers]


def root_rejection_rates(proposers, sampling: SamplingParams, trees: int, seed: int) -> tuple[float, float]:
    """Measured root rejection rates of verify_stochastic and of NS, on the same drafted trees."""
    drafters = [(LookupDrafter(lm, i, f"ssm{i}"), DraftSpec((k,), rule, sampling), make_generator(seed, i + 1))
                for i, (lm, rule, k) in enumerate(proposers)]
    p_root = TARGET.probs(sampling)[PROMPT][None]  # [1, V]: only the root is ever verified here
    mss_generator, ns_generator = make_generator(seed, 0), make_generator(seed, 99)
    mss = ns = 0
    for _ in range(trees):
        proposal = merge([d.draft(d.new_state(), list(PROMPT), spec, g) for d, spec, g in drafters])
        probs = p_root.expand(proposal.tree.size, -1)  # [N, V]
        mss += len(verify_stochastic(proposal, probs, mss_generator).path) == 1
        ns += len(verify_naive(proposal, probs, ns_generator).path) == 1
    return mss / trees, ns / trees


@pytest.mark.parametrize("name,proposers,sampling", THEOREM_CASES, ids=[c[0] for c in THEOREM_CASES])
def test_rule_is_lossless_and_beats_naive_sampling(name, proposers, sampling):
    """Exactly (no sampling): the emitted token is p-distributed, and MSS rejects at most as
    often as NS (SpecInfer Theorem 4.3); then the engine's measured rates match the exact ones."""
    p_table = TARGET.probs(sampling).numpy()
    for context in CONTEXTS:
        out, mss, ns = exact_root(p_table[context], root_args(proposers, sampling, context))
        np.testing.assert_allclose(out, p_table[context], atol=1e-9)
        assert mss <= ns + 1e-12, context
        if all(rule == "top_k" for _, rule, _ in proposers):
            assert mss == pytest.approx(ns, abs=1e-9)
        if context == PROMPT:
            exact_mss, exact_ns = mss, ns
    measured_mss, measured_ns = root_rejection_rates(proposers, sampling, TREES, seed=3)
    print(f"\ntheorem 4.3 {name}: exact MSS {exact_mss:.4f} <= NS {exact_ns:.4f}; "
          f"measured MSS {measured_mss:.4f}, NS {measured_ns:.4f} over {TREES} trees")
    for measured, exact in ((measured_mss, exact_mss), (measured_ns, exact_ns)):
        assert abs(measured - exact) <= 4.5 * np.sqrt(exact * (1 - exact) / TREES) + 1e-9


@pytest.mark.parametrize("name,proposers,edit", [
    ("top-k children through the MSS ratio", ((SSM_A, "top_k_as_sampled", 2),), None),
    ("merge keeping one draw per token", ((SSM_A, "sampled", 2), (SSM_B, "sampled", 2)), first_draw_per_token),
], ids=["biased top-k", "one draw per token"])
def test_exact_check_rejects_biased_rules(name, proposers, edit):
    """The exact check has teeth: two wrong rules leave p (total variation printed)."""
    p = TARGET.probs(T1).numpy()[PROMPT]
    out, _, _ = exact_root(p, root_args(proposers, T1, PROMPT), edit)
    distance = 0.5 * np.abs(out - p).sum()
    print(f"\nexact negative control {name}: total variation from p {distance:.4f}")
    assert distance > 1e-3


WEIGHTS = st.lists(  # unnormalised distributions over 5 tokens
    st.floats(0.0, 1.0, allow_subnormal=False), min_size=5, max_size=5).filter(lambda w: sum(w) > 0.01)


def _distribution(weights: list[float]) -> np.ndarray:
    weights = np.asarray(weights, dtype=np.float64)
    return weights / weights.sum()


@settings(max_examples=60)
@given(p=WEIGHTS, q=WEIGHTS, q2=WEIGHTS, rule=st.sampled_from(["sampled", "sampled_without_replacement", "top_k"]),
       k=st.integers(1, 3))
def test_rule_is_lossless_and_beats_naive_sampling_for_any_p_and_q(p, q, q2, rule, k):
    """Any p, a proposer with any q, merged with a second sampled proposer (duplicates included)."""
    p, q, q2 = _distribution(p), _distribution(q), _distribution(q2)
    for proposers in ([(q, np.log(q + 1e-30), rule, k)], [(q, np.log(q + 1e-30), rule, k), (q2, q2, "sampled", 1)]):
        out, mss, ns = exact_root(p, proposers)
        np.testing.assert_allclose(out, p, atol=1e-9)
        assert mss <= ns + 1e-12


def fixed_root_proposal(draws) -> Proposal:
    """Per-proposer depth-1 proposals from the engine's TreeBuilder, merged as the engine merges.

    draws: [(token, proposer, q # [V] or None)], grouped by proposer (merge keeps that order)."""
    assert [d[1] for d in draws] == sorted(d[1] for d in draws), "group the draws by proposer"
    builders: dict[int, TreeBuilder] = {}
    for token, proposer, q in draws:
        builder = builders.setdefault(proposer, TreeBuilder(root=PROMPT[-1], proposer=proposer))
        builder.add(0, token, None if q is None else torch.as_tensor(q, dtype=torch.float32))
    return merge([builder.build() for builder in builders.values()])


def _fixed_trees():
    """Root draw lists that stress the rule: shared tokens with two q's, repeats, zeros of p."""
    p, a, b = (lm.probs(T1).numpy()[PROMPT] for lm in (TARGET, SSM_A, SSM_B))
    x, y, z = (int(t) for t in np.argsort(p - a)[:3])  # a(t) > p(t): every trial is a real coin
    a_no_x = np.where(np.arange(VOCAB) == x, 0.0, a) / (1 - a[x])
    p5, a5 = (lm.probs(TOP5).numpy()[PROMPT] for lm in (TARGET, SSM_A))
    outside, top = int(np.argmax(np.where(p5 == 0, a5, -1.0))), int(np.argmax(p5))
    return [
        # name, sampling (of p), draws (token, proposer, q), a one-draw-per-token merge is visible
        ("one token, two q's (merged), then a repeat", T1, [(x, 0, b), (x, 1, a), (y, 1, a), (x, 1, a)], True),
        ("without replacement", T1, [(x, 0, a), (y, 0, a_no_x)], False),
        ("sampled twice, then deterministic", T1, [(y, 0, a), (y, 0, a), (z, 1, None)], True),
        ("top_k 5: p is 0 at a drafted token", TOP5, [(outside, 0, a5), (z, 0, a5), (top, 1, None)], False),
    ]


FIXED_TREES = _fixed_trees()


@pytest.mark.parametrize("name,sampling,draws,dedupe_visible", FIXED_TREES, ids=[c[0] for c in FIXED_TREES])
def test_engine_verifier_follows_the_rule_on_a_fixed_tree(name, sampling, draws, dedupe_visible):
    """Given one fixed tree (built and merged by the engine), verify_stochastic's emitted token
    has the exact rule's distribution (which is not p: only the average over drafting is).
    Catches slips the drafting average hides, e.g. a merge or builder that drops a repeat draw."""
    p = TARGET.probs(sampling)[PROMPT]  # [V]
    proposal = fixed_root_proposal(draws)
    rule_draws = [(t, None if q is None else np.float32(q).astype(np.float64)) for t, _, q in draws]
    probs, generator, tokens = p[None].expand(proposal.tree.size, -1), make_generator(11, 0), proposal.tree.tokens
    emitted = []
    for _ in range(SAMPLES):
        verdict = verify_stochastic(proposal, probs, generator)
        emitted.append((int(tokens[verdict.path[1]]) if len(verdict.path) > 1 else verdict.next_token,))
    result = chi_square(emitted, mss_node(p.numpy(), rule_draws)[0])
    report(f"fixed tree: {name}", result)
    assert result.pvalue > THRESHOLD
    if dedupe_visible:  # the same samples refute the one-draw-per-token rule
        wrong = chi_square(emitted, mss_node(p.numpy(), first_draw_per_token(rule_draws))[0])
        report(f"fixed tree: {name}, against one draw per token", wrong)
        assert wrong.pvalue < THRESHOLD


# ---------------------------------------------------------------------------------------------
# 3 and 5. End to end through SpeculativeEngine with tiny random Llamas.

E2E_VOCAB = 16
E2E_PROMPT = (1, 5, 9)


@functools.lru_cache(maxsize=None)
def e2e_models():
    """The tiny target and SSM, the same in every process (seeded), built once per process."""
    return tiny_llama(E2E_VOCAB, seed=11, layers=2), tiny_llama(E2E_VOCAB, seed=12, layers=1)


@functools.lru_cache(maxsize=None)
def e2e_engine() -> SpeculativeEngine:
    """The in-process engine over ``e2e_models``, one a process."""
    target, ssm = e2e_models()
    drafters = [ModelDrafter(ssm, 0, "ssm")]
    return SpeculativeEngine(TargetModel(target), drafters, tiny_tokenizer(E2E_VOCAB), eos_ids=())


def generate_alone(requests: list[GenerationRequest]) -> list[tuple[tuple[int, ...], object]]:
    """(token ids, stats) of each request, run alone by this process's ``e2e_engine``."""
    return [(r.token_ids, r.stats) for r in map(e2e_engine().generate, requests)]


@pytest.fixture(scope="module")
def tiny_models():
    return e2e_models()


@pytest.fixture(scope="module")
def tiny_engine() -> SpeculativeEngine:
    return e2e_engine()


@pytest.fixture(scope="module")
def tiny_batched_engine(tiny_models) -> SpeculativeEngine:
    """The same models over paged KV pools, run by the engine loop 16 requests at a time."""
    from engine.loop import LoopLimits
    from engine.paged_models import PagedDrafter, PagedTarget, paged_parts

    target, ssm = tiny_models
    target_pool, target_batcher = paged_parts(target, 4096)
    ssm_pool, ssm_batcher = paged_parts(ssm, 4096)
    drafters = [PagedDrafter(ssm, 0, "ssm", ssm_pool, ssm_batcher)]
    return SpeculativeEngine(PagedTarget(target, target_pool, target_batcher), drafters, tiny_tokenizer(E2E_VOCAB),
                             eos_ids=(), limits=LoopLimits(max_running=16, max_waiting=E2E_SAMPLES))


def generate_batched(engine: SpeculativeEngine, requests: list[GenerationRequest]) -> tuple[list, int]:
    """Every request submitted to the engine loop at once, the loop stepped by hand until all have
    finished: (each request's last update, the most requests one iteration ran)."""
    loop = engine.loop
    ids = [loop.submit(request) for request in requests]
    last, most = {}, 0
    while loop.has_work:
        most = max(most, loop.step().running)
        for request_id in ids:
            if request_id in loop.requests:
                for update in loop.take(request_id):
                    tokens = last.get(request_id, ((), None))[0] + update.token_ids
                    last[request_id] = (tokens, update.stats)
    return [last[i] for i in ids], most


E2E_CASES = [
    ("tree (2,2) sampled", SpeculationOptions("tree", (2, 2), children="sampled"), T1),
    ("tree (2,2) top_k", SpeculationOptions("tree", (2, 2), children="top_k"), T1),
    ("sequence depth 2", SpeculationOptions("sequence", sequence_depth=2), T1),
]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name,options,sampling", E2E_CASES, ids=[c[0] for c in E2E_CASES])
@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_engine_first_two_tokens_are_target_distributed(tiny_batched_engine, tiny_models, walk_pool, name, options,
                                                        sampling, batched):
    requests = [GenerationRequest(E2E_PROMPT, 2, replace(sampling, seed=seed), options) for seed in range(E2E_SAMPLES)]
    if batched:
        results, most = generate_batched(tiny_batched_engine, requests)
        assert most == 16  # requests shared their passes
    else:  # each request seeded: its output is the same in whichever process runs it
        half = walk_pool.submit(generate_alone, requests[E2E_SAMPLES // 2:])
        results = generate_alone(requests[:E2E_SAMPLES // 2]) + half.result()
    samples = [tokens for tokens, _ in results]
    accepted = sum(stats.accepted_tokens for _, stats in results)
    result = chi_square(samples, target_first_two(tiny_models[0], E2E_PROMPT, sampling))
    report(f"end-to-end {name}{' batched' if batched else ''}", result)
    print(f"     {accepted} draft tokens accepted over {E2E_SAMPLES} requests")
    assert result.pvalue > THRESHOLD
    assert accepted > 0.15 * E2E_SAMPLES  # speculation really happened


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_biased_verifier_in_the_loop_is_rejected_at_the_same_size(tiny_batched_engine, tiny_models, monkeypatch):
    """Negative control of the end-to-end cases through the loop: the same requests, sample size and
    chi-square test reject a verifier that accepts every first draw."""
    name, options, sampling = E2E_CASES[1]
    monkeypatch.setattr("engine.step.verify_stochastic", accept_first_draws)
    requests = [GenerationRequest(E2E_PROMPT, 2, replace(sampling, seed=seed), options) for seed in range(E2E_SAMPLES)]
    results, _ = generate_batched(tiny_batched_engine, requests)
    result = chi_square([tokens for tokens, _ in results], target_first_two(tiny_models[0], E2E_PROMPT, sampling))
    report(f"NEGATIVE CONTROL end-to-end {name} batched, first draws accepted", result)
    assert result.pvalue < THRESHOLD


REPRO_OPTIONS = [
    SpeculationOptions("tree", (2, 2, 1), children="sampled"),
    SpeculationOptions("tree", (3, 1), children="sampled_without_replacement"),
    SpeculationOptions("sequence", sequence_depth=3),
]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("options", REPRO_OPTIONS, ids=["tree sampled", "tree without replacement", "sequence"])
def test_seeded_requests_are_reproducible(tiny_engine, options):
    def run(seed: int) -> tuple[int, ...]:
        sampling = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, seed=seed)
        return tiny_engine.generate(GenerationRequest(E2E_PROMPT, 12, sampling, options)).token_ids

    assert run(5) == run(5)
    outputs = [run(seed) for seed in range(6)]
    assert len(set(outputs)) >= 4  # different seeds, different samples


@pytest.fixture(scope="module")
def self_drafting_engine(tiny_models) -> SpeculativeEngine:
    """The target drafting for itself (a copy): its trees are often accepted, so its guesses hit."""
    target, _ = tiny_models
    return SpeculativeEngine(TargetModel(target), [ModelDrafter(copy.deepcopy(target), 0, "self")],
                             tiny_tokenizer(E2E_VOCAB), eos_ids=())


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("options", REPRO_OPTIONS, ids=["tree sampled", "tree without replacement", "sequence"])
def test_seeded_output_is_the_same_with_prefetch(tiny_engine, self_drafting_engine, options):
    """With prefetch (trees drafted ahead while the target verifies) each seed gives the tokens it
    gives without: as a function of the seed the output is unchanged, so its distribution is the
    one the tests above check. Some prepared trees were used (hits), not only discarded."""
    hits = 0
    for engine in (tiny_engine, self_drafting_engine):
        for seed in range(6):
            sampling = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, seed=seed)
            off, on = (engine.generate(GenerationRequest(E2E_PROMPT, 12, sampling, replace(options, prefetch=n)))
                       for n in (0, 4))
            assert on.token_ids == off.token_ids
            hits += on.stats.prefetch_hits
    assert hits > 0


# ---------------------------------------------------------------------------------------------
# 6. `specinfer generate` takes the sampling flags.


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_cli_generate_sampling_flags(tmp_path, capsys, monkeypatch):
    from cluster.cli import main

    monkeypatch.delenv("SPECINFER_MODELS", raising=False)
    models, tokenizer = tmp_path / "models", tiny_tokenizer(E2E_VOCAB)
    save_tiny_pair(models, E2E_VOCAB, target_seed=11, ssm_seed=12)
    config = tmp_path / "tiny.yaml"
    config.write_text(
        f"models_dir: {models}\ndtype: float32\ntarget: {{name: tiny-target, source: tiny-target}}\n"
        "ssms:\n  - {name: tiny-ssm, source: tiny-ssm}\nsuffix: null\n"
        "speculation: {mode: tree, expansion: [2, 2], max_tree_nodes: 16}\ndefaults: {max_new_tokens: 8}\n"
    )
    capsys.readouterr()  # save_pretrained may import DeepSpeed (through accelerate), which logs to stdout

    def generate(*flags: str) -> dict:
        argv = ["generate", "--config", str(config), "--prompt", "w1 w5 w9", "--json", *flags]
        assert main(argv) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)

    sampled = ("--temperature", "0.8", "--top-p", "0.95", "--top-k", "12", "--children", "sampled")
    first, again = generate(*sampled, "--seed", "3"), generate(*sampled, "--seed", "3")
    assert first["token_ids"] == again["token_ids"] and len(first["token_ids"]) == 8
    assert first["token_ids"] != generate(*sampled, "--seed", "4")["token_ids"]  # sampling is on: seeds matter
    assert first["mode"] == "tree" and first["draft_tokens"] > 0
    assert first["text"] == tokenizer.decode(first["token_ids"], skip_special_tokens=True)
    # --top-k 1 and a tiny --top-p each collapse sampling to the greedy output, whatever the seed.
    greedy = generate("--temperature", "0")["token_ids"]
    for flags in (("--top-k", "1", "--seed", "1"), ("--top-p", "0.01", "--seed", "2")):
        assert generate("--temperature", "0.8", "--children", "sampled", *flags)["token_ids"] == greedy
