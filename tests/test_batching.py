"""Continuous batching over the paged KV pool, in-process (fp32 tiny models).

The engine loop (``engine.loop``) steps every running request together: one packed target forward
per iteration and one SSM forward per tree level. The tests step it by hand (requests join at
chosen iterations), or from threads that share it. Outputs must equal each request run alone and
the target's own greedy ``generate``; the pool's blocks must all come back.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.paged_models import PagedDrafter, PagedTarget, paged_parts
from actors.suffix import SuffixDrafter
from engine.draft import ModelDrafter
from engine.requests import GenerationRequest, SpeculationOptions
from engine.generate import SpeculativeEngine
from engine.loop import LoopLimits
from engine.kv_pool import BlockPool, KVStorage, PagedSequence, PoolExhausted
from engine.models import onednn_linears
from engine.packed import ForwardItem, PagedModel, chain_item
from engine.sampling import SamplingParams
from engine.target import TargetModel
from engine.tree import TokenTree, ancestor_mask, positions
from serving_fixtures import batch_hold
from tests.tiny_models import IdTokenizer, reference_greedy, tiny_model

VOCAB = 97


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(2)
    return tiny_model("llama", VOCAB, layers=2, seed=0), tiny_model("llama", VOCAB, layers=1, seed=1)


def batched_engine(models, eos=(), tokens: int = 4096, block_size: int = 16,
                   chunk_tokens: int | None = None) -> SpeculativeEngine:
    target, ssm = models
    target_pool, target_batcher = paged_parts(target, tokens, block_size)
    ssm_pool, ssm_batcher = paged_parts(ssm, tokens, block_size, chunk_tokens=chunk_tokens)
    drafters = [PagedDrafter(ssm, 0, "ssm", ssm_pool, ssm_batcher), SuffixDrafter(1)]
    return SpeculativeEngine(PagedTarget(target, target_pool, target_batcher), drafters, IdTokenizer(), eos, 1024,
                             limits=LoopLimits(chunk_tokens=chunk_tokens))


def run_loop(engine, requests, joins) -> tuple[list[list[int]], list]:
    """Step the engine's loop by hand, request i submitted before iteration ``joins[i]``, until every
    request finished: (each request's tokens, each iteration's IterationStats)."""
    loop, outputs, ids, stats = engine.loop, [[] for _ in requests], {}, []
    while len(ids) < len(requests) or loop.has_work:
        for i, request in enumerate(requests):
            if joins[i] == len(stats):
                ids[i] = loop.submit(request)
        stats.append(loop.step())
        for i, request_id in ids.items():
            if request_id in loop.requests:
                outputs[i].extend(t for update in loop.take(request_id) for t in update.token_ids)
    return outputs, stats


def item_counts(runner) -> list[int]:
    """Record how many items each packed forward of ``runner`` (a PagedModel) runs; the list it fills."""
    counts, forward = [], runner.forward

    def recording(items):
        counts.append(len(items))
        return forward(items)

    runner.forward = recording
    return counts


def pools(engine: SpeculativeEngine) -> list[BlockPool]:
    return [engine.target.pool, engine.drafters[0].pool]


def run_threads(engine, requests, delays, stop_after=None) -> list[list[int]]:
    """Each request on its own thread, started after its delay; ``stop_after[i]`` steps then cancel."""
    outputs: list = [None] * len(requests)

    def run(i: int) -> None:
        time.sleep(delays[i])
        tokens, stream = [], engine.stream(requests[i])
        for step, update in enumerate(stream):
            tokens.extend(update.token_ids)
            if stop_after and stop_after[i] is not None and step + 1 >= stop_after[i]:
                stream.close()  # a cancel: the session releases its blocks
                break
        outputs[i] = tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return outputs


TREE = SpeculationOptions(expansion=(2, 2, 1))
MIXED = [  # (prompt, max_new_tokens, speculation): mixed lengths and modes in one batch
    (tuple(range(3, 8)), 20, TREE),
    (tuple(range(10, 40)), 33, TREE),
    (tuple(range(5, 17)), 7, SpeculationOptions(mode="incremental")),
    (tuple(range(20, 31)), 41, SpeculationOptions(mode="sequence", sequence_depth=3)),
    (tuple([7, 7, 9, 7, 7, 9, 7]), 25, SpeculationOptions(expansion=(3, 1, 1), proposers=("suffix",))),
    (tuple(range(40, 90)), 12, SpeculationOptions(expansion=(2, 1, 1, 1), min_confidence=0.2)),
]


def test_batched_greedy_equals_alone_and_generate(models):
    engine = batched_engine(models)
    requests = [GenerationRequest(p, n, speculation=s) for p, n, s in MIXED]
    expected = [reference_greedy(models[0], list(p), n) for p, n, _ in MIXED]
    assert [list(engine.generate(r).token_ids) for r in requests] == expected  # alone
    target_items, ssm_items = item_counts(engine.target.packed), item_counts(engine.drafters[0].packed)
    outputs, stats = run_loop(engine, requests, joins=[0, 0, 0, 1, 3, 4])  # three at once, then joins mid-run
    assert outputs == expected
    assert target_items[0] == 3 and max(target_items) >= 5, target_items  # prefills and trees share a pass
    assert len(target_items) == len(stats)  # one target pass per iteration
    assert max(ssm_items) >= 2, ssm_items  # the tree requests' levels share SSM forwards
    assert all(pool.num_free == pool.num_blocks and pool.num_unreserved == pool.num_blocks for pool in pools(engine))
    assert not engine.drafters[1].shared.active_requests  # every request stopped in the suffix proposer


def test_threads_sharing_the_loop_get_their_own_outputs(models):
    """Callers on their own threads (``SpeculativeEngine.stream``) step the one loop in turn."""
    engine = batched_engine(models)
    requests = [GenerationRequest(p, n, speculation=s) for p, n, s in MIXED]
    expected = [reference_greedy(models[0], list(p), n) for p, n, _ in MIXED]
    assert run_threads(engine, requests, delays=[0.0] * len(requests)) == expected
    assert all(pool.num_free == pool.num_blocks for pool in pools(engine))


def test_eos_inside_trees_and_a_cancel_mid_run(models):
    prompts = [tuple(range(12, 30)), tuple(range(50, 56)), tuple(range(60, 75))]
    references = [reference_greedy(models[0], list(p), 30) for p in prompts]
    eos = references[0][9]  # an EOS the first request meets mid-output (maybe inside a tree)
    engine = batched_engine(models, eos=[eos])
    requests = [GenerationRequest(p, 30, speculation=TREE) for p in prompts]
    outputs = run_threads(engine, requests, delays=[0.0, 0.0, 0.02], stop_after=[None, 2, None])
    for output, reference in zip([outputs[0], outputs[2]], [references[0], references[2]]):
        cut = reference.index(eos) + 1 if eos in reference else len(reference)
        assert output == reference[:cut]
    assert outputs[1] == references[1][:len(outputs[1])] and 2 <= len(outputs[1]) < 30  # cancelled after 2 steps
    assert all(pool.num_free == pool.num_blocks for pool in pools(engine))


def test_sampled_requests_with_different_settings_in_one_batch_are_reproducible(models):
    engine = batched_engine(models)
    settings_ = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_k=10, seed=2),
                 SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, top_p=0.9, seed=3)]
    children = ["sampled", "sampled_without_replacement", "top_k", "top_k"]
    # Not adaptive: the suffix proposer's global store would otherwise hold the earlier runs' answers.
    requests = [GenerationRequest(tuple(range(20, 32)), 24, s, SpeculationOptions(expansion=(2, 2), children=c,
                                                                                   adaptive=False))
                for s, c in zip(settings_, children)]
    alone = [engine.generate(r).token_ids for r in requests]
    batched = run_threads(engine, requests, delays=[0.0] * 4)
    assert [tuple(b) for b in batched] == alone


TREES = [([5, 6, 7, 8], [-1, 0, 1, 2]), ([5, 6, 7, 8, 9, 10, 11], [-1, 0, 0, 1, 1, 2, 5]), ([42], [-1])]


@pytest.mark.parametrize("linears", ["torch", "onednn", "onednn_packed"])
def test_packed_forward_logits_equal_the_dynamic_cache_path(models, linears):
    """Three requests packed into one forward: each one's tree logits equal TargetModel's alone,
    before and after a commit of a non-first branch (with torch's and with oneDNN's linears)."""
    target = models[0]
    if linears != "torch":  # a fresh copy: the fixture's models stay on torch's path
        target = tiny_model("llama", VOCAB, layers=2, seed=0)
        assert onednn_linears(target, 0, packed=linears == "onednn_packed") == 15
    pool = BlockPool.for_tokens(1024, block_size=4)
    paged, plain = PagedModel(target, pool), TargetModel(target)
    prompts = [list(range(10, 10 + n)) for n in (5, 13, 2)]
    sequences, states = [PagedSequence(pool) for _ in prompts], [plain.new_state() for _ in prompts]
    paged.forward([chain_item(s, p) for s, p in zip(sequences, prompts)])
    for sequence, state, prompt in zip(sequences, states, prompts):
        sequence.keep(list(range(len(prompt))))
        plain.prefill(state, prompt)
    trees = [TokenTree(torch.tensor(t), torch.tensor(p)) for t, p in TREES]
    for _ in range(2):
        items = [ForwardItem(s, t.tokens, positions(t.parents, s.length), ancestor_mask(t.parents),
                             torch.arange(t.size)) for s, t in zip(sequences, trees)]
        packed = paged.forward(items)
        for logits, sequence, state, tree in zip(packed, sequences, states, trees):
            prefix = state.length
            expected = plain.forward_tree(state, tree)
            assert (logits - expected).abs().max().item() < 1e-4
            path = (0, tree.size - 1) if tree.size > 1 else (0,)
            plain.commit(state, prefix, path)
            sequence.keep(list(path))
            assert sequence.length == state.length


def test_an_item_the_pool_cannot_hold_fails_alone(models):
    """One request of a packed forward needs more blocks than the pool has: it gets PoolExhausted
    and keeps nothing, the other request's logits equal its own forward alone."""
    target = models[0]
    pool = BlockPool.for_tokens(32, block_size=4)
    paged = PagedModel(target, pool)
    small, huge = PagedSequence(pool), PagedSequence(pool)
    expected = PagedModel(target, BlockPool.for_tokens(32, block_size=4))
    alone = expected.forward([chain_item(PagedSequence(expected.pool), list(range(10, 16)))])[0]
    logits, error = paged.forward([chain_item(small, list(range(10, 16))), chain_item(huge, list(range(40)))])
    assert isinstance(error, PoolExhausted) and huge.blocks == [] and huge.pending == 0
    assert torch.equal(logits, alone)
    small.release()
    assert pool.counts() == (8, 8, 8)


def test_block_table_slots_and_keep_move_only_the_path():
    pool = BlockPool(num_blocks=8, block_size=4)
    storage = KVStorage(num_layers=1, kv_heads=1, head_dim=1, slots=pool.num_slots, dtype=torch.float32)
    sequence = PagedSequence(pool)
    slots = sequence.append(10)  # entries 0..9 as speculative
    storage.keys[0][0, slots, 0] = torch.arange(10, dtype=torch.float32)
    sequence.keep(list(range(6)))  # commit 6, drop 4: nothing moves
    assert (sequence.length, len(sequence.blocks)) == (6, 2) and pool.take_moves().shape == (2, 0)
    new = sequence.append(5)  # tree nodes 0..4 at entries 6..10
    storage.keys[0][0, new, 0] = torch.tensor([60.0, 61, 62, 63, 64])
    sequence.keep([0, 3, 4])
    moves = pool.take_moves()  # [2, 2]: entries 9, 10 -> 7, 8 (the storage applies them in the next forward)
    assert moves.tolist() == [sequence.slots(9, 11).tolist(), sequence.slots(7, 9).tolist()]
    storage.move(moves)
    assert storage.keys[0][0, sequence.slots(0, 9), 0].tolist() == [0, 1, 2, 3, 4, 5, 60, 63, 64]
    assert len(sequence.blocks) == 3 and pool.num_free == 5
    sequence.release()
    assert pool.num_free == 8


def test_blocks_freed_by_a_truncation_stay_reserved_for_their_sequence():
    pool = BlockPool(num_blocks=4, block_size=4)
    holder = PagedSequence(pool, reserve_tokens=16)  # the whole pool
    holder.append(12)
    holder.keep([0])  # 3 blocks in use, 2 freed by the commit
    assert (pool.num_free, pool.num_unreserved) == (3, 0)
    with pytest.raises(PoolExhausted):
        PagedSequence(pool, reserve_tokens=4)  # nobody may take the holder's freed blocks
    holder.append(15)  # and the holder can still grow to its full reservation
    holder.release()
    assert (pool.num_free, pool.num_unreserved) == (4, 4)


def test_reservation_admits_by_memory():
    pool = BlockPool(num_blocks=4, block_size=4)
    first = PagedSequence(pool, reserve_tokens=10)  # 3 blocks promised
    with pytest.raises(PoolExhausted):
        PagedSequence(pool, reserve_tokens=5)  # 2 more do not fit
    second = PagedSequence(pool, reserve_tokens=4)
    first.append(10)
    with pytest.raises(PoolExhausted):
        second.append(5)  # beyond its own reservation, nothing unreserved is left
    first.release()
    second.release()
    assert (pool.num_free, pool.num_unreserved) == (4, 4)


@settings(max_examples=60)
@given(st.lists(st.tuples(st.sampled_from(["append", "keep", "truncate", "release"]), st.integers(0, 3),
                          st.integers(1, 9)), max_size=40))
def test_pool_accounting_property(operations):
    """Any mix of appends, commits, truncations and releases: used + free blocks = all blocks,
    every block is owned at most once, and releasing everything restores the pool."""
    pool = BlockPool(num_blocks=64, block_size=3)
    sequences = [PagedSequence(pool, reserve_tokens=6) for _ in range(4)]
    for operation, index, count in operations:
        sequence = sequences[index]
        if operation == "append":
            needed = pool.blocks_for(sequence.length + sequence.pending + count) - len(sequence.blocks)
            if needed <= sequence.reserved + pool.num_unreserved:
                sequence.append(count)
            else:
                with pytest.raises(PoolExhausted):
                    sequence.append(count)
        elif operation == "keep" and sequence.pending:
            sequence.keep(list(range(min(count, sequence.pending))))
        elif operation == "truncate":
            sequence.truncate(count)
        elif operation == "release":
            sequence.release()
        owned = [block for s in sequences for block in s.blocks]
        assert len(owned) == len(set(owned)) and len(owned) + pool.num_free == pool.num_blocks
        assert pool.num_free - pool.num_unreserved == sum(s.reserved for s in sequences)  # promises kept
        assert all(len(s.blocks) == pool.blocks_for(s.length + s.pending) for s in sequences)
    for sequence in sequences:
        sequence.release()
    assert pool.num_free == pool.num_unreserved == pool.num_blocks


def test_plain_model_path_still_works_after_paging(models):
    """The paged attention falls back to SDPA without a packed batch: one model serves both paths."""
    target, ssm = models
    paged_parts(target, 256)
    engine = SpeculativeEngine(TargetModel(target), [ModelDrafter(ssm, 0, "ssm")], IdTokenizer(), [], 1024)
    prompt = tuple(range(30, 45))
    assert list(engine.generate(GenerationRequest(prompt, 16, speculation=TREE)).token_ids) == reference_greedy(
        target, list(prompt), 16)


BUDGETS = [  # (curve, slack, min nodes, disable above, running -> expected per-request nodes)
    ({1: 185, 4: 190, 8: 222, 16: 280, 32: 410}, 0.6, 2, None, {1: 16, 2: 8, 4: 4, 8: 2, 16: 2}),
    ({1: 100, 2: 100, 4: 300}, 1.0, 1, None, {1: 2, 2: 1, 3: 1}),
    ({1: 10, 64: 15, 128: 19}, 1.0, 3, None, {1: 128, 8: 16, 64: 3}),
    ({1: 10, 64: 15, 128: 19}, 1.0, 3, 8, {1: 128, 8: 16, 9: 1, 64: 1}),  # above 8 running: plain decoding
]


@pytest.mark.parametrize("curve,slack,minimum,disable_above,expected", BUDGETS)
def test_tree_budget_from_the_verify_cost_curve(curve, slack, minimum, disable_above, expected):
    from engine.budget import budget_from_curve

    budget = budget_from_curve(curve, slack, minimum, disable_above)
    assert {running: budget.per_request(running) for running in expected} == expected


def test_a_one_node_budget_drafts_nothing():
    """A budget of the root alone (speculation disabled at this load): no proposer is called."""
    from engine.step import Session

    class NoDrafts:
        async def prefill(self, prompt_ids):
            return 1

        async def draft(self, committed, plan):
            raise AssertionError("drafted with a one-node budget")

        async def verify(self, drafted):
            from engine.step import step_outcome
            from engine.verify import Verdict

            assert drafted.proposal.tree.size == 1
            return step_outcome(drafted, Verdict((0,), 2, bonus=True), 1.0)

        def release(self):
            pass

    from engine.step import iterate_sync

    session = Session(NoDrafts(), GenerationRequest((5, 6), 4), ("ssm",), (True,), IdTokenizer(), (),
                      tree_budget=lambda: 1)
    updates = list(iterate_sync(session.updates()))
    assert [u.token_ids for u in updates] == [(1,), (2,), (2,), (2,)]


def test_measure_curve_stops_past_the_limit_and_keeps_the_faster_reference():
    from engine.budget import measure_curve

    costs = iter([999.0, 100.0, 100.0, 110.0, 150.0, 250.0, 90.0])  # warm-up, 1, 2, 4, 8, 16 (> 2x: stop), 1
    curve = measure_curve(lambda size: next(costs), max_tokens=64, slack=1.0)
    assert curve == {1: 90.0, 2: 100.0, 4: 110.0, 8: 150.0, 16: 250.0}


@pytest.mark.parametrize("max_tokens,slack,timings,calls,expected", [
    # Sweep 1 stops past 2x the one-token pass; sweep 2 hits a slow stretch; the medians ignore it.
    (64, 1.0, {1: [100, 130, 100, 96], 2: [100, 180, 104], 4: [110, 200, 112], 8: [150, 220, 150],
               16: [250, 300, 260]},
     [1, 1, 2, 4, 8, 16] + [1, 2, 4, 8, 16] * 2 + [1],
     {1: 100, 2: 104, 4: 112, 8: 150, 16: 260}),
    # Passes past RESWEEP_MAX_TOKENS (16) are timed once.
    (32, float("inf"), {1: [50, 60, 40, 55], 2: [52, 70, 51], 4: [54, 54, 90], 8: [60, 61, 62],
                        16: [80, 70, 75], 32: [120]},
     [1, 1, 2, 4, 8, 16, 32] + [1, 2, 4, 8, 16] * 2 + [1],
     {1: 52.5, 2: 52, 4: 54, 8: 61, 16: 75, 32: 120}),
])
def test_measure_curve_sweeps_take_each_sizes_median(max_tokens, slack, timings, calls, expected):
    from engine.budget import measure_curve

    seen, left = [], {size: list(times) for size, times in timings.items()}

    def time_pass(size: int) -> float:
        seen.append(size)
        return 999.0 if len(seen) == 1 else float(left[size].pop(0))  # the first pass warms up

    assert measure_curve(time_pass, max_tokens, slack, sweeps=3) == expected
    assert seen == calls
    assert not any(left.values())  # every timing was used


def test_tree_budget_trims_the_schedule_not_the_drawn_tree():
    """A budget of 4 nodes keeps the first levels of the expansion (decided before drafting)."""
    from engine.step import plan_proposers

    plan = plan_proposers(("ssm",), (True,), SpeculationOptions(expansion=(2, 2, 1), max_tree_nodes=4))
    assert plan[0].spec.schedule == (2,)  # 1 + 2 nodes; a second level would make 7


def test_under_load_cost_aware_trees_plan_against_the_others_and_leave_the_cap_to_the_rest():
    """With a RunningLoad, a cost-aware model's spec carries the other requests' share of the pass
    and the request's own max_tree_nodes (the goodput decides its size); the suffix proposer keeps
    the equal share. Each step records what the request put into the pass; closing leaves."""
    from engine.budget import RunningLoad
    from engine.shape import BatchLoad, TreeCost
    from engine.step import Drafted, Session, iterate_sync, root_only_proposal, step_outcome
    from engine.verify import Verdict

    plans = []

    class Recording:
        async def prefill(self, prompt_ids):
            return 1

        async def draft(self, committed, plan):
            plans.append(plan)
            return Drafted(root_only_proposal(committed[-1]))

        async def verify(self, drafted):
            return step_outcome(drafted, Verdict((0,), 2, bonus=True), 1.0)

        def release(self):
            pass

    load = RunningLoad(fade=0.5)
    load.join("other")
    load.record("other", 6, 3)  # 6 tokens in the pass, expected 0.5 * 1 + 0.5 * 3 = 2
    session = Session(Recording(), GenerationRequest((5, 6), 3), ("ssm", "suffix"), (True, False), IdTokenizer(),
                      (), tree_budget=lambda: 2, cost=TreeCost(((1, 100.0), (2, 110.0))), load=load)
    assert load.others("other") == BatchLoad(1, 1.0)  # joined as a decode step
    updates = list(iterate_sync(session.updates()))
    assert [u.token_ids for u in updates] == [(1,), (2,), (2,)]
    model, suffix = plans[0]
    assert model.spec.cost_aware and model.spec.cost.load == BatchLoad(6, 2.0)
    assert (model.spec.max_nodes, suffix.spec.max_nodes) == (64, 2)  # the request's own bound; the cap
    assert load.others("other") == BatchLoad(1, 1.0)  # root-only steps committing one token each
    session.close()
    assert load.others("other") == BatchLoad(0, 0.0)


def chain_sizes(batcher) -> list[int]:
    """Record the token count of every chain item (prefill or catching up: one logits row) the
    batcher's model runs; returns the list it fills."""
    sizes, forward = [], batcher.model.forward

    def recording(items):
        sizes.extend(len(item.tokens) for item in items if len(item.rows) == 1)
        return forward(items)

    batcher.model.forward = recording
    return sizes


def test_chunked_prefill_equals_generate_and_no_forward_takes_more_than_a_chunk(models):
    """Prompts longer than the chunk (30 and 50 tokens, chunks of 12) are fed 12 tokens per forward,
    target and SSM alike, while the others step; outputs still equal generate, blocks all return."""
    engine = batched_engine(models, chunk_tokens=12)
    sizes = [chain_sizes(engine.target.batcher), chain_sizes(engine.drafters[0].batcher)]
    requests = [GenerationRequest(p, n, speculation=s) for p, n, s in MIXED]
    expected = [reference_greedy(models[0], list(p), n) for p, n, _ in MIXED]
    outputs, stats = run_loop(engine, requests, joins=[0, 0, 1, 2, 3, 4])
    assert outputs == expected
    assert max(s.prompt_tokens for s in stats) <= 12  # all prompts together: at most a chunk per pass
    for recorded in sizes:
        assert max(recorded) == 12, recorded  # chunks of 12, none larger
    assert all(pool.num_free == pool.num_blocks and pool.num_unreserved == pool.num_blocks for pool in pools(engine))


@pytest.mark.parametrize("chunk,forwards", [(4, 3), (5, 2), (10, 1), (None, 1)])
def test_chunked_prefill_gives_the_one_forward_logits_and_entries(models, chunk, forwards):
    """feed: 10 prompt tokens in chunks of 4 are 3 forwards (4, 4, 2); the logits after the prompt
    and every KV entry equal those of one forward (fp32, up to rounding)."""
    from engine.paged_models import feed

    target = models[0]
    reference_pool, reference = paged_parts(target, 64, 4)
    pool, batcher = paged_parts(target, 64, 4, chunk_tokens=chunk)
    prompt = list(range(30, 40))
    whole, state = PagedSequence(reference_pool), PagedSequence(pool)
    one, chunked = feed(reference, whole, prompt), feed(batcher, state, prompt)
    assert batcher.counters.forwards == forwards and state.length == whole.length == 10
    torch.testing.assert_close(chunked, one, rtol=1e-5, atol=1e-5)
    ours, theirs = batcher.model.runner.storage, reference.model.runner.storage
    for mine, other in zip(ours.keys + ours.values, theirs.keys + theirs.values):
        torch.testing.assert_close(mine[:, state.slots(0, 10)], other[:, whole.slots(0, 10)], rtol=1e-5, atol=1e-5)


def test_a_chunk_must_hold_a_token(models):
    with pytest.raises(ValueError, match="chunk_tokens"):
        paged_parts(models[0], 64, 4, chunk_tokens=0)


def test_prompts_arriving_together_are_prefilled_one_chunk_budget_at_a_time(models):
    """Three prompts (6, 4 and 2 tokens) queued together with chunk_tokens 8: no forward takes more
    than 8 prompt tokens, so they need two forwards (whatever their order), where one forward of
    12 would delay every first token; each prefill's logits equal its own alone."""
    from engine.paged_models import feed

    target = models[0]
    pool, batcher = paged_parts(target, 256, 4, chunk_tokens=8)
    per_forward, forward = [], batcher.model.forward

    def recording(items):
        per_forward.append(sum(len(item.tokens) for item in items if item.prompt is not None))
        return forward(items)

    batcher.model.forward = recording
    prompts = [list(range(10, 16)), list(range(20, 24)), list(range(30, 32))]
    logits = [None] * 3

    def run(i):
        logits[i] = feed(batcher, PagedSequence(pool), prompts[i], prompt=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    with batch_hold(batcher.hold_next, 3):  # all three queued before the first forward, whatever the timing
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert len(per_forward) == 2 and max(per_forward) <= 8 and sum(per_forward) == 12, per_forward
    alone_pool, alone = paged_parts(target, 256, 4)
    for prompt, got in zip(prompts, logits):
        torch.testing.assert_close(got, feed(alone, PagedSequence(alone_pool), prompt), rtol=1e-5, atol=1e-5)


def prompt_ticket(n, began=None, remaining=None):
    from engine.batcher import _Ticket
    from engine.packed import PromptChunk

    chunk = None if began is None else PromptChunk(began, n if remaining is None else remaining)
    return _Ticket(ForwardItem(None, torch.zeros(n, dtype=torch.long), torch.arange(n), torch.ones(n, n).bool(),
                               torch.tensor([n - 1]), chunk))


def test_prompt_chunks_go_in_the_order_their_prompts_began_before_any_timing():
    """The batcher's split (the docstring's example): every item that is not a prompt chunk goes;
    with no forward timed yet, prompt chunks go earliest-begun prompt first, up to chunk_tokens,
    and once one waits the later ones wait too."""
    from engine.batcher import ForwardBatcher

    batcher = ForwardBatcher(model=None, chunk_tokens=8)
    tree, late, first, second = prompt_ticket(5), prompt_ticket(4, 3.0), prompt_ticket(6, 1.0), prompt_ticket(2, 2.0)
    batch, rest = batcher._split([tree, late, first, second])
    assert (batch, rest) == ([tree, first, second], [late])
    batch, rest = batcher._split([prompt_ticket(9, 2.0), prompt_ticket(1, 1.0)])  # an early small chunk, then a big one
    assert [len(t.item.tokens) for t in batch] == [1] and [len(t.item.tokens) for t in rest] == [9]


@pytest.mark.parametrize("tickets, first_forward", [
    # a burst (begun together): the shortest prompts fill the budget, the long one waits
    ([(8, 100.0, 300), (3, 100.0, 3), (2, 100.001, 2), (6, 100.0, 6)], [2, 3]),
    # the docstring's example, 0.01 s per token: a long prompt begun at 0 (3.0) after a short one begun at 1 (1.4)
    ([(8, 0.0, 300), (4, 1.0, 40)], [4]),
    # ... but before one begun at 2.9 (3.3): newer prompts never starve it
    ([(8, 0.0, 300), (4, 2.9, 40)], [8]),
])
def test_prompt_chunks_go_in_the_order_they_would_finish_alone(tickets, first_forward):
    """With 0.01 s per prompt token measured: the earliest finish, prefilled alone from when the
    prompt began (began + tokens left x seconds per token), goes first."""
    from engine.batcher import ForwardBatcher

    batcher = ForwardBatcher(model=None, chunk_tokens=8)
    batcher.s_per_token = 0.01
    batch, rest = batcher._split([prompt_ticket(n, began, left) for n, began, left in tickets])
    assert [len(t.item.tokens) for t in batch] == first_forward
    assert sorted(len(t.item.tokens) for t in batch + rest) == sorted(n for n, _, _ in tickets)


def test_feed_marks_each_chunk_with_its_prompts_start_and_tokens_left_and_only_prompt_forwards_set_the_rate(models):
    """10 prompt tokens in chunks of 4: chunks marked (began, 10), (began, 6), (began, 2), one
    ``began``; a decode feed (not a prompt) is unmarked and leaves ``s_per_token`` as it was."""
    from engine.paged_models import feed

    pool, batcher = paged_parts(models[0], 64, 4, chunk_tokens=4)
    marks, forward = [], batcher.model.forward

    def recording(items):
        marks.extend(item.prompt for item in items)
        return forward(items)

    batcher.model.forward = recording
    state = PagedSequence(pool)
    feed(batcher, state, list(range(10, 20)), prompt=True)
    assert [m.remaining for m in marks] == [10, 6, 2] and len({m.began for m in marks}) == 1
    rate = batcher.s_per_token
    assert rate > 0
    feed(batcher, state, [30, 31])
    assert marks[-1] is None and batcher.s_per_token == rate


class FakeClock:
    """A monotonic clock the test moves by hand (the batcher's waits then never run out by themselves)."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("queued, now, burst, longest, left", [
    ([(6, 10.00), (2, 10.02)], 10.03, 0.03, 0.15, 0.02),  # the docstring's example: quiet since 10.02
    ([(6, 10.00), (2, 10.02)], 10.06, 0.03, 0.15, 0.0),   # quiet for 0.04: the burst is in
    ([(6, 10.00), (2, 10.02), (3, 10.04), (4, 10.13)], 10.15, 0.03, 0.15, 0.0),  # arrivals keep coming: capped
    ([(6, 10.00), (2, 10.02)], 10.03, 0.03, 0.0, 0.0),    # a cap below the quiet gap: the gap is the cap
    ([(6, 10.00), (1, None)], 10.01, 0.03, 0.15, 0.0),    # a running request's item is queued: nobody waits
    ([(6, 10.00)], 10.01, 0.0, 0.15, 0.0),                # burst waits off
    ([], 10.01, 0.03, 0.15, 0.0),                         # nothing queued
])
def test_new_prompts_wait_for_the_rest_of_their_burst_only(queued, now, burst, longest, left):
    from engine.batcher import BatchWaits, ForwardBatcher

    batcher = ForwardBatcher(model=None, waits=BatchWaits(burst_s=burst, burst_max_s=longest), clock=FakeClock(now))
    batcher._queue = [prompt_ticket(n, began) for n, began in queued]
    assert batcher._burst_left() == pytest.approx(left)


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_burst_is_gathered_then_prefilled_shortest_first_and_a_running_request_ends_the_wait(models):
    """With the clock stopped, a new prompt alone never runs (it waits for its burst); a second,
    shorter prompt joins it; once the burst's time is up the shorter goes first (chunk budget 6:
    forwards of 2 then 6 prompt tokens). Then a new prompt waits again until a running request's
    decode feed is queued, and both go in one forward without the clock moving."""
    from engine.batcher import BatchWaits, ForwardBatcher
    from engine.paged_models import feed

    clock, pool = FakeClock(), BlockPool.for_tokens(256, 4)
    batcher = ForwardBatcher(PagedModel(models[0], pool), BatchWaits(burst_s=0.05, burst_max_s=0.05), chunk_tokens=6,
                             clock=clock)
    batcher.s_per_token = 0.01  # as if timed: order by finish alone, not by arrival
    per_forward, forward = [], batcher.model.forward

    def recording(items):
        per_forward.append([len(item.tokens) for item in items])
        return forward(items)

    batcher.model.forward = recording
    states = [PagedSequence(pool) for _ in range(3)]
    threads = [threading.Thread(target=feed, args=(batcher, states[i], list(range(10 * i + 10, 10 * i + n))),
                                kwargs={"prompt": True}) for i, n in enumerate((16, 12, 13))]  # 6, 2, 3 tokens
    threads[0].start()
    wait_until(lambda: len(batcher._queue) == 1, "the first prompt queued")
    time.sleep(0.2)  # the clock is stopped: no amount of waiting lets it run alone
    assert per_forward == []
    threads[1].start()
    wait_until(lambda: len(batcher._queue) == 2, "the second prompt queued")
    clock.now += 0.05
    for thread in threads[:2]:
        thread.join(30)
    assert per_forward == [[2], [6]]
    threads[2].start()
    wait_until(lambda: len(batcher._queue) == 1, "a third prompt queued")
    feed(batcher, states[0], [40])  # a running request's next token: the new prompt waits no longer
    threads[2].join(30)
    assert sorted(per_forward[2]) == [1, 3] and len(per_forward) == 3 and clock.now == 100.05


def test_a_thread_whose_result_is_ready_returns_instead_of_leading_the_next_forward(models):
    """Three prompts (2, 5 and 6 tokens) queued together, a chunk budget of 6: three forwards, each
    leaving prompts for the next. Every forward runs on a thread still waiting for its own item
    (in that forward or still queued), never on one whose result is ready: that request would
    get its result a whole forward late (a burst's first token was, 1.5 s at 8 streams)."""
    from engine.paged_models import feed

    pool, batcher = paged_parts(models[0], 256, 4, chunk_tokens=6)
    owner, leaders, forward = {}, [], batcher.model.forward

    def recording(items):
        pending = [item.sequence for item in items] + [ticket.item.sequence for ticket in batcher._queue]
        leaders.append(any(sequence is owner[threading.current_thread()] for sequence in pending))
        return forward(items)

    def run(n):
        state = owner[threading.current_thread()] = PagedSequence(pool)
        feed(batcher, state, list(range(10, 10 + n)), prompt=True)
        state.release()

    batcher.model.forward = recording
    for _ in range(10):
        threads = [threading.Thread(target=run, args=(n,)) for n in (2, 5, 6)]
        with batch_hold(batcher.hold_next, 3):  # all three queued before the first forward
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
    assert len(leaders) == 30 and all(leaders), leaders


@pytest.mark.parametrize("last, value, expected", [(None, 30.0, 30.0), (30.0, 40.0, 32.0), (32.0, 32.0, 32.0)])
def test_moving_average_starts_at_the_first_measurement_then_keeps_four_fifths(last, value, expected):
    from engine.timing import moving_average

    assert moving_average(last, value) == pytest.approx(expected)


@pytest.mark.parametrize("last, value, keep, expected", [(None, 30.0, 0.5, 30.0), (30.0, 40.0, 0.5, 35.0),
                                                         (30.0, 40.0, 0.0, 40.0)])
def test_moving_average_keeps_the_weight_asked_for(last, value, keep, expected):
    """The draft gate's averages keep half (``engine.draft_gate.FADE``)."""
    from engine.timing import moving_average

    assert moving_average(last, value, keep) == pytest.approx(expected)


# -- Attention over a request's slots (engine.packed.attend). -------------------------------------


@pytest.mark.parametrize("batch, heads, kv_heads, queries, keys, softcap", [
    (1, 6, 2, 3, 10, None),  # grouped query heads: 3 per KV head
    (1, 4, 4, 1, 7, None),  # one query, as in a decode step
    (2, 8, 2, 5, 9, None),  # several requests' segments at once
    (1, 4, 2, 4, 6, 5.0),  # a logit softcap (gemma2)
])
def test_matmul_attention_is_sdpa_and_the_eager_softcap(batch, heads, kv_heads, queries, keys, softcap):
    """fp32: the matmul path equals SDPA with the additive mask (or, with a softcap, the eager
    computation over repeated KV heads), masked keys included."""
    import torch.nn.functional as F

    from engine.packed import matmul_attention

    generator = torch.Generator().manual_seed(queries * keys)
    q, k, v = (torch.randn(batch, h, n, 16, generator=generator)
               for h, n in ((heads, queries), (kv_heads, keys), (kv_heads, keys)))
    visible = torch.rand(batch, 1, queries, keys, generator=generator) > 0.3
    visible[..., 0] = True
    bias = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    if softcap is None:
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    else:
        groups = heads // kv_heads
        scores = q @ k.repeat_interleave(groups, 1).transpose(2, 3) * 16 ** -0.5
        weights = torch.softmax(torch.tanh(scores / softcap) * softcap + bias, dim=-1)
        expected = weights @ v.repeat_interleave(groups, 1)
    torch.testing.assert_close(matmul_attention(q, k, v, bias, None, softcap), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, queries, expected", [
    (torch.bfloat16, 1, True), (torch.bfloat16, 16, True), (torch.bfloat16, 17, False),
    (torch.float16, 4, True), (torch.float32, 1, False),  # float32: SDPA is as fast, and exactness is checked in it
])
def test_matmul_wins_for_few_reduced_precision_queries_on_a_cpu(dtype, queries, expected):
    from engine.packed import matmul_wins

    assert matmul_wins(torch.zeros(1, 4, queries, 8, dtype=dtype)) is expected
