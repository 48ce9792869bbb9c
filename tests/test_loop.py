"""The engine loop (``engine.loop``) stepped by hand, and the forward programs it runs
(``engine.programs``): admission and its queue, one pass per iteration, errors that stay with their
request, per-iteration statistics. fp32 tiny models; no clocks, no threads."""

from __future__ import annotations

import pytest
import torch

from actors.suffix import SuffixDrafter
from engine.draft import ModelDrafter
from engine.generate import SpeculativeEngine
from engine.kv_pool import PoolExhausted
from engine.phases import local_loop
from engine.loop import DraftJob, EngineLoop, LoopLimits, LoopRequest, QueueFull, prefill_order
from engine.paged_models import PagedDrafter, PagedTarget, paged_parts
from engine.programs import Forward, alone, run_alone, run_round, run_rounds, start
from engine.requests import GenerationRequest, SpeculationOptions
from engine.sampling import SamplingParams
from engine.step import plan_proposers
from engine.target import TargetModel
from tests.tiny_models import IdTokenizer, reference_greedy, tiny_model

VOCAB = 97
TREE = SpeculationOptions(expansion=(2, 2, 1))


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(2)
    return tiny_model("llama", VOCAB, layers=2, seed=0), tiny_model("llama", VOCAB, layers=1, seed=1)


def paged_loop(models, tokens: int = 4096, limits: LoopLimits = LoopLimits(), block_size: int = 16) -> EngineLoop:
    target, ssm = models
    target_pool, target_batcher = paged_parts(target, tokens, block_size)
    ssm_pool, ssm_batcher = paged_parts(ssm, 4096, block_size)
    drafters = [PagedDrafter(ssm, 0, "ssm", ssm_pool, ssm_batcher), SuffixDrafter(1)]
    return local_loop(PagedTarget(target, target_pool, target_batcher), drafters, IdTokenizer(), (), limits)


def drain(loop: EngineLoop, ids: list[int], outputs: dict | None = None) -> dict[int, list[int]]:
    """Step until the loop is idle; every request's tokens."""
    outputs = outputs if outputs is not None else {i: [] for i in ids}
    while loop.has_work:
        loop.step()
        collect(loop, outputs)
    collect(loop, outputs)
    return outputs


def collect(loop: EngineLoop, outputs: dict) -> None:
    for request_id in list(outputs):
        if request_id in loop.requests:
            outputs[request_id].extend(t for u in loop.take(request_id) for t in u.token_ids)


def pools_whole(loop: EngineLoop) -> bool:
    pools = [loop.executor.target.pool, loop.executor.drafters[0].pool]
    return all(p.num_free == p.num_blocks and p.num_unreserved == p.num_blocks for p in pools)


# -- Forward programs. ---------------------------------------------------------------------------


class CountingRunner:
    """A runner that doubles its items and records each batch; an item of None fails alone."""

    def __init__(self):
        self.batches: list[list] = []

    def forward(self, items):
        self.batches.append(list(items))
        return [ValueError("bad item") if item is None else 2 * item for item in items]


def twice(runner, first, second):
    a = yield Forward(runner, first)
    b = yield Forward(runner, second)
    return a + b


def once(runner, item):
    return (yield Forward(runner, item))


def test_rounds_run_one_batch_per_runner_with_every_waiting_item():
    m, n = CountingRunner(), CountingRunner()
    programs = [start(twice(m, 1, 2)), start(once(m, 10)), start(once(n, 5))]
    assert run_rounds(programs) == 2
    assert m.batches == [[1, 10], [2]] and n.batches == [[5]]
    assert [p.result for p in programs] == [6, 20, 10]


def test_an_items_error_goes_to_its_program_alone():
    m = CountingRunner()
    programs = [start(twice(m, 1, None)), start(twice(m, 3, 4))]
    run_rounds(programs)
    assert isinstance(programs[0].error, ValueError) and programs[0].result is None
    assert programs[1].result == 14 and programs[1].error is None


def test_a_round_can_leave_programs_waiting():
    m = CountingRunner()
    programs = [start(once(m, 1)), start(once(m, 2))]
    assert run_round(programs, chosen=lambda running: running is programs[0]) == 1
    assert programs[0].result == 2 and not programs[1].done and m.batches == [[1]]


def test_run_alone_runs_callables_and_raises_their_errors():
    def program():
        value = yield alone(lambda: 21)
        return 2 * value

    def failing():
        yield alone(lambda: 1 / 0)

    assert run_alone(program()) == 42
    with pytest.raises(ZeroDivisionError):
        run_alone(failing())


# -- The loop. -------------------------------------------------------------------------------------


def test_the_queue_is_bounded_and_refuses_with_its_limit(models):
    loop = paged_loop(models, limits=LoopLimits(max_running=1, max_waiting=1))
    first = loop.submit(GenerationRequest(tuple(range(3, 9)), 4))  # the free running place
    second = loop.submit(GenerationRequest(tuple(range(5, 12)), 4))  # the queue
    with pytest.raises(QueueFull, match=r"1 requests waiting beyond the 1 running \(limit 1\)"):
        loop.submit(GenerationRequest(tuple(range(3, 9)), 4))
    loop.step()  # the first runs, the second still waits: no room
    assert (loop.last.running, loop.last.waiting) == (1, 1)
    with pytest.raises(QueueFull):
        loop.submit(GenerationRequest(tuple(range(3, 9)), 4))
    outputs = drain(loop, [first, second])
    assert outputs[first] == reference_greedy(models[0], list(range(3, 9)), 4)
    assert outputs[second] == reference_greedy(models[0], list(range(5, 12)), 4)


def test_a_request_waits_for_kv_blocks_then_runs(models):
    """A pool that holds one request's worst case: the second waits in the queue (no error, no
    clock) until the first gives its blocks back."""
    prompts = [tuple(range(10, 30)), tuple(range(40, 60))]
    loop = paged_loop(models, tokens=160, limits=LoopLimits(max_running=4))
    ids = [loop.submit(GenerationRequest(p, 24, speculation=TREE)) for p in prompts]
    loop.step()
    assert (loop.last.running, loop.last.waiting) == (1, 1)
    outputs = drain(loop, ids)
    assert [outputs[i] for i in ids] == [reference_greedy(models[0], list(p), 24) for p in prompts]
    assert pools_whole(loop)


def test_a_request_larger_than_the_pool_fails_alone(models):
    loop = paged_loop(models, tokens=64)
    too_big = loop.submit(GenerationRequest(tuple(range(1, 60)), 40))
    loop.step()
    with pytest.raises(PoolExhausted):
        loop.take(too_big)
    fits = loop.submit(GenerationRequest(tuple(range(1, 8)), 6, speculation=SpeculationOptions(mode="incremental")))
    assert drain(loop, [fits])[fits] == reference_greedy(models[0], list(range(1, 8)), 6)


def test_a_failed_draft_ends_its_request_and_the_others_go_on(models, monkeypatch):
    original = PagedDrafter._level_program

    def fail_for_long_prompts(self, state, builder, level, cached, depth, committed_length):
        if committed_length > 40:
            raise RuntimeError("injected SSM failure")
        return (yield from original(self, state, builder, level, cached, depth, committed_length))

    monkeypatch.setattr(PagedDrafter, "_level_program", fail_for_long_prompts)
    loop = paged_loop(models)
    bad = loop.submit(GenerationRequest(tuple(range(1, 50)), 10, speculation=TREE))
    good = loop.submit(GenerationRequest(tuple(range(1, 10)), 10, speculation=TREE))
    outputs = {good: []}
    while loop.has_work:
        loop.step()
        collect(loop, outputs)
    loop.take(bad)  # its first token came before the failure
    with pytest.raises(RuntimeError, match="injected"):
        loop.take(bad)
    assert outputs[good] == reference_greedy(models[0], list(range(1, 10)), 10)
    assert pools_whole(loop)
    with pytest.raises(RuntimeError, match="injected"):  # a caller of stream sees the error too
        list(loop.stream(GenerationRequest(tuple(range(1, 50)), 10, speculation=TREE)))
    assert pools_whole(loop) and not loop.requests


def test_cancel_while_waiting_and_while_running_gives_the_blocks_back(models):
    loop = paged_loop(models, limits=LoopLimits(max_running=1))
    running = loop.submit(GenerationRequest(tuple(range(3, 20)), 30, speculation=TREE))
    waiting = loop.submit(GenerationRequest(tuple(range(3, 20)), 30))
    loop.step()
    loop.step()
    loop.cancel(waiting)
    loop.cancel(running)
    assert not loop.has_work or loop.step().running == 0
    assert pools_whole(loop) and not loop.requests


def test_a_cancel_during_the_pass_releases_after_it_and_the_others_go_on(models, monkeypatch):
    """A served loop awaits its actors; a client's cancel (another task) lands inside the pass. The
    request's states go back once the pass returns, not under the executor's feet."""
    loop = paged_loop(models)
    cancelled = loop.submit(GenerationRequest(tuple(range(3, 20)), 30, speculation=TREE))
    other = loop.submit(GenerationRequest(tuple(range(5, 15)), 12, speculation=TREE))
    loop.step()  # both prefilled
    executor, verify, released = loop.executor, loop.executor.verify, []
    release = executor.release
    monkeypatch.setattr(executor, "release", lambda request_id: (released.append(request_id), release(request_id)))

    async def verify_with_a_cancel(drafted, trees, chunks):
        loop.cancel(cancelled)
        assert released == []  # still in the pass: its states stay until the verdicts are in
        return await verify(drafted, trees, chunks)

    monkeypatch.setattr(executor, "verify", verify_with_a_cancel)
    stats = loop.step()
    assert released == [cancelled] and stats.running == 1
    monkeypatch.setattr(executor, "verify", verify)
    outputs = drain(loop, [other])
    assert outputs[other] == reference_greedy(models[0], list(range(5, 15)), 12)  # its outbox kept every token
    assert pools_whole(loop) and cancelled not in loop.requests


def test_seeded_sampling_does_not_depend_on_who_else_runs(models):
    """The same seeded requests alone and joining a busy loop at different iterations."""
    sampling = [SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=1.1, top_k=12, seed=8)]
    options = SpeculationOptions(expansion=(2, 2), children="sampled", adaptive=False)
    requests = [GenerationRequest(tuple(range(20, 32)), 20, s, options) for s in sampling]
    alone_outputs = []
    for request in requests:
        loop = paged_loop(models)
        request_id = loop.submit(request)
        alone_outputs.append(drain(loop, [request_id])[request_id])
    loop = paged_loop(models)
    others = [loop.submit(GenerationRequest(tuple(range(5, 15)), 25, SamplingParams(temperature=1.0, seed=s), options))
              for s in (1, 2)]
    outputs = {i: [] for i in others}
    loop.step()
    ids = [loop.submit(requests[0])]
    loop.step()
    loop.step()
    ids.append(loop.submit(requests[1]))
    outputs.update({i: [] for i in ids})
    drain(loop, ids + others, outputs)
    assert [outputs[i] for i in ids] == alone_outputs
    assert all(len(outputs[i]) == 25 for i in others)


def test_iteration_stats_add_up_to_the_requests_own(models):
    loop = paged_loop(models)
    seen = []
    loop.observers.append(seen.append)
    ids = [loop.submit(GenerationRequest(p, 16, speculation=TREE)) for p in (tuple(range(3, 9)), tuple(range(30, 50)))]
    stats = {}
    outputs = {i: [] for i in ids}
    while loop.has_work:
        loop.step()
        for i in ids:
            if i in loop.requests:
                for update in loop.take(i):
                    outputs[i].extend(update.token_ids)
                    stats[i] = update.stats
    assert [s.iteration for s in seen] == list(range(1, len(seen) + 1))
    assert sum(s.emitted_tokens for s in seen) == sum(len(o) for o in outputs.values()) == 32
    assert sum(s.drafted_tokens for s in seen) == sum(st.draft_tokens for st in stats.values())
    assert sum(s.accepted_tokens for s in seen) == sum(st.accepted_tokens for st in stats.values())
    # vLLM's num_drafts: each request's verify steps whose tree held a draft token
    drafts = sum(size > 0 for st in stats.values() for size in st.tree_sizes)
    assert sum(s.drafts for s in seen) == drafts > 0
    assert sum(s.prompt_tokens for s in seen) == 6 + 20
    assert seen[0].kv_blocks_used > 0 and seen[-1].kv_blocks_used == 0 and seen[-1].running == 0
    assert set(seen[0].ms) == {"schedule", "draft", "verify", "commit"}


def test_a_burst_prefills_the_shortest_prompts_first_and_packs_them():
    """Chunks of 64: prompts of 100, 20 and 30 tokens arriving together. The two short ones share
    the first pass and have their first token after it; the long one takes the next two passes.
    (Admission order would feed 64 of the long one first and everyone's first token would come later.)"""
    lengths = (100, 20, 30)
    loop = EngineLoop.__new__(EngineLoop)  # only the scheduling state is used
    loop.limits = LoopLimits(chunk_tokens=64)
    loop.running = [LoopRequest(i, GenerationRequest(tuple(range(n)), 4), prompt_left=n) for i, n in enumerate(lengths)]
    passes = []
    while any(r.prefilling for r in loop.running):
        chosen = loop._chunks_this_pass()
        passes.append([(r.id, min(r.prompt_left, 64)) for r in chosen])
        for r in chosen:
            r.prompt_left -= min(r.prompt_left, 64)
    assert passes == [[(1, 20), (2, 30)], [(0, 64)], [(0, 36)]]


@pytest.mark.parametrize("waits, expected", [
    (0, [1, 2, 0]),  # 40, 90, 300 left: shortest first
    (2, [1, 0, 2]),  # the 300 passed over twice counts as 300 - 2 * 128 = 44: before the 90
    (3, [0, 1, 2]),  # three times: -84, first of all
])
def test_prefill_order_ages_a_long_prompt_past_new_short_ones(waits, expected):
    requests = [LoopRequest(i, GenerationRequest((1,), 1), prompt_left=n) for i, n in enumerate((300, 40, 90))]
    requests[0].passed_over = waits
    assert [r.id for r in prefill_order(requests, 128)] == expected
    assert [r.id for r in prefill_order(requests, None)] == [0, 1, 2]  # whole prompts: admission order


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones(models):
    """Chunks of 16; a 48-token prompt, and a new 10-token prompt before every pass. Shortest first
    alone would feed the short ones for as long as they come; with aging the long one is passed over
    three times (48 - 3 * 16 = 0 < 10), then fed 16 a pass. Every output stays exact."""
    loop = paged_loop(models, limits=LoopLimits(max_running=16, chunk_tokens=16))
    prompts = [tuple(range(2, 50))]
    ids = [loop.submit(GenerationRequest(prompts[0], 4))]
    long_left = []
    for k in range(8):
        prompts.append(tuple(range(60 + k, 70 + k)))
        ids.append(loop.submit(GenerationRequest(prompts[-1], 4)))
        loop.step()
        long_left.append(loop.requests[ids[0]].prompt_left if ids[0] in loop.requests else None)
    assert long_left[:6] == [48, 48, 48, 32, 16, 0]
    outputs = drain(loop, ids)
    assert [outputs[i] for i in ids] == [reference_greedy(models[0], list(p), 4) for p in prompts]


def test_unpacked_models_run_in_the_loop_one_item_at_a_time(models):
    """A DynamicCache target and SSM: the same phases, each forward alone; outputs exact."""
    target, ssm = models
    engine = SpeculativeEngine(TargetModel(target), [ModelDrafter(ssm, 0, "ssm"), SuffixDrafter(1)], IdTokenizer(),
                               (), 1024)
    prompts = [tuple(range(3, 11)), tuple(range(20, 44)), tuple(range(50, 57))]
    ids = [engine.loop.submit(GenerationRequest(p, 18, speculation=TREE)) for p in prompts]
    outputs = drain(engine.loop, ids)
    assert [outputs[i] for i in ids] == [reference_greedy(target, list(p), 18) for p in prompts]
    assert engine.loop.last.kv_blocks_used is None


@pytest.mark.parametrize("limits, message", [
    (dict(max_running=0), "max_running must be >= 1"),
    (dict(max_waiting=-1), "max_waiting >= 0"),
    (dict(chunk_tokens=0), "chunk_tokens must be >= 1"),
])
def test_limits_are_checked(limits, message):
    with pytest.raises(ValueError, match=message):
        LoopLimits(**limits)


# -- bench/loop_load.py: the loop under load. ----------------------------------------------------


@pytest.mark.parametrize("curve, streams, expected", [
    ({1: 200.0, 8: 320.0}, 8, 25.0),
    ({1: 200.0, 8: 320.0}, 4, 4 / 0.2514286),
    ({1: 200.0, 8: 320.0}, 16, None),  # past the measured curve
    (None, 4, None),
])
def test_forward_limit_is_streams_per_pass_at_the_curves_cost(curve, streams, expected):
    from bench.loop_levels import forward_limit

    assert forward_limit(curve, streams) == (pytest.approx(expected) if expected else None)


LEVEL_CURVE = {1: 10.0, 2: 11.0, 4: 12.0}  # the verify-cost curve the levels are summarised against


def test_loop_load_levels_are_exact_and_ratios_are_against_incremental(models):
    """Both methods at two levels on the tiny pair: every output the target's greedy output, and
    each level's ratio taken against incremental's tok/s at the same level."""
    from bench.loop_levels import summarise
    from bench.loop_load import run_level
    from bench.methods import Method
    from bench.workloads import EncodedPrompt, Prompt

    loop = paged_loop(models)
    engine = type("Engine", (), {"loop": loop})()
    prompts = [tuple(range(3, 11)), tuple(range(20, 33)), tuple(range(40, 46))]
    workload = [EncodedPrompt(Prompt(str(i), "", False), p) for i, p in enumerate(prompts)]
    methods = [Method("incremental", "engine", SpeculationOptions(mode="incremental")), Method("tree", "engine", TREE)]
    levels = [run_level(engine, m, workload, s, 12) for s in (1, 3) for m in methods]
    for level in levels:
        for key, output in level["outputs"].items():
            prompt = prompts[(int(key) - min(map(int, level["outputs"]))) % len(prompts)]
            assert output == reference_greedy(models[0], list(prompt), 12)
    rows = summarise(levels, LEVEL_CURVE)
    for row in rows:
        base = next(r for r in rows if r["streams"] == row["streams"] and r["method"] == "incremental")
        assert row["vs_incremental"] == pytest.approx(row["aggregate_tokens_per_s"] / base["aggregate_tokens_per_s"])
    assert rows[2]["forward_limit_tokens_per_s"] == pytest.approx(3 / 0.0115)
    assert [r["new_tokens"] for r in rows] == [12, 12, 36, 36]
    for row in rows:  # every iteration is prefill or decode; every token is counted in one of them
        prefill, decode = row["profile"]["prefill"], row["profile"]["decode"]
        assert prefill["iterations"] >= 1 and prefill["iterations"] + decode["iterations"] == row["iterations"]
        assert prefill["emitted_tokens"] + decode["emitted_tokens"] == row["new_tokens"]
    decode = rows[2]["profile"]["decode"]  # incremental, 3 streams: its limit at its tokens per pass
    batch = decode["emitted_tokens"] / decode["iterations"]
    assert rows[2]["decode_of_limit"] == pytest.approx(decode["tokens_per_s"] / forward_limit_at(batch))


def forward_limit_at(batch: float) -> float:
    from bench.loop_levels import forward_limit

    return forward_limit(LEVEL_CURVE, batch)


def stats(prompt_tokens: int, emitted: int, ms: float, running: int = 2):
    from engine.loop import IterationStats

    return IterationStats(0, running, 0, 0, None, None, 0, 0, emitted, prompt_tokens,
                          {"schedule": 0.0, "draft": 0.0, "verify": ms, "commit": 0.0})


def test_split_profile_worked_example():
    """Two decode iterations of 300 ms emitting 8 tokens each and one prefill of 1,200 ms."""
    from bench.loop_levels import split_profile

    profile = split_profile([stats(40, 2, 1200.0), stats(0, 8, 300.0), stats(0, 8, 300.0)])
    assert profile["prefill"]["iterations"] == 1 and profile["prefill"]["seconds"] == pytest.approx(1.2)
    assert profile["prefill"]["emitted_tokens"] == 2 and profile["prefill"]["phase_ms"]["verify"] == 1200.0
    decode = profile["decode"]
    assert (decode["iterations"], decode["emitted_tokens"]) == (2, 16) and decode["seconds"] == pytest.approx(0.6)
    assert decode["tokens_per_s"] == pytest.approx(16 / 0.6) and decode["phase_ms"]["verify"] == 300.0
    assert split_profile([stats(40, 1, 900.0)])["decode"] == {
        "iterations": 0, "seconds": 0.0, "emitted_tokens": 0, "running_mean": 0.0,
        "phase_ms": {"schedule": 0.0, "draft": 0.0, "verify": 0.0, "commit": 0.0}, "tokens_per_s": None}


@pytest.mark.parametrize("before, after, expected", [
    ({1: 200.0, 8: 300.0}, {1: 220.0, 8: 340.0}, {1: 210.0, 8: 320.0}),
    ({1: 200.0, 8: 300.0}, {1: 220.0}, {1: 210.0}),  # the sizes both have
    ({1: 200.0}, None, {1: 200.0}),
    (None, None, None),
])
def test_mean_curve_averages_the_curves_before_and_after(before, after, expected):
    from bench.loop_load import mean_curve

    assert mean_curve(before, after) == expected


@pytest.mark.parametrize("disable_above, expected", [(16, 16), (None, None)])
def test_loop_load_runs_every_level_at_once_and_may_disable_speculation_above(disable_above, expected):
    from pathlib import Path

    from bench.loop_load import level_config
    from settings.config import load_config

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")
    run = level_config(config, 32, disable_above)
    assert run.server.max_concurrent_requests == 32 and run.server.tree_budget.disable_above_running == expected
    assert run.server.tree_budget.slack == config.server.tree_budget.slack  # the rest as configured


def test_gate_ab_runs_each_speculative_method_without_the_gate_too_and_keeps_the_gate(models):
    from bench.loop_levels import variants
    from bench.loop_load import run_level
    from bench.methods import Method
    from bench.workloads import EncodedPrompt, Prompt

    methods = [Method("incremental", "engine", SpeculationOptions(mode="incremental")), Method("tree", "engine", TREE)]
    assert [(m.spelling, gated) for m, gated in variants(methods, True)] == [
        ("incremental", True), ("tree", True), ("tree", False)]
    assert [(m.spelling, gated) for m, gated in variants(methods, False)] == [("incremental", True), ("tree", True)]
    loop = paged_loop(models)
    loop.gate = gate = object()  # whatever the engine's gate is, a level without it puts it back
    engine = type("Engine", (), {"loop": loop})()
    level = run_level(engine, methods[1], [EncodedPrompt(Prompt("0", "", False), tuple(range(3, 9)))], 1, 4, False)
    assert level["method"] == "tree (no gate)" and loop.gate is gate


def test_busy_streams_run_their_requests_back_to_back_with_at_most_one_each_running(models):
    """2 streams x 3 requests each: 6 requests, never more than 2 running, every output the target's
    own greedy decoding of its prompt (the prompts cycled)."""
    from bench.loop_levels import measure_level
    from bench.methods import Method
    from bench.workloads import EncodedPrompt, Prompt

    prompts = [tuple(range(3, 9)), tuple(range(30, 44)), (7, 3, 9)]
    workload = [EncodedPrompt(Prompt(str(i), "", False), p) for i, p in enumerate(prompts)]
    engine = type("Engine", (), {"loop": paged_loop(models)})()
    run = measure_level(engine, Method("tree", "engine", TREE), workload, 2, 5, per_stream=3)
    assert len(run.tokens) == 6 and max(s.running for s in run.iterations) == 2
    expected = [reference_greedy(models[0], list(prompts[i % 3]), 5) for i in range(6)]
    assert [run.outputs[i] for i in sorted(run.outputs)] == expected and set(run.first) == set(run.tokens)


def test_repeated_rounds_are_pooled_per_method():
    """Two rounds of incremental around one of tree: each method's figures pool its own rounds."""
    from bench.loop_levels import LevelRun, grouped, level_figures

    one = [stats(0, 4, 100.0)]
    runs = [LevelRun("incremental", 2, 1.0, {0: 4, 1: 4}, {0: 100.0, 1: 300.0}, one, {0: [1]}),
            LevelRun("tree", 2, 0.5, {2: 8}, {2: 50.0}, one, {2: [2]}),
            LevelRun("incremental", 2, 3.0, {3: 8}, {3: 200.0}, one * 2, {3: [3]})]
    groups = grouped(runs)
    assert [[r.method for r in group] for group in groups] == [["incremental", "incremental"], ["tree"]]
    figures = level_figures(groups[0])
    assert figures["aggregate_tokens_per_s"] == 16 / 4.0 and figures["runs_tokens_per_s"] == [8.0, 8 / 3.0]
    assert (figures["repeats"], figures["ttft_ms_p50"], figures["iterations"]) == (2, 200.0, 3)
    assert figures["outputs"] == {"0": [1]}  # the first round's


def test_run_levels_alternates_the_methods_within_each_round(monkeypatch):
    import argparse

    import bench.loop_load as loop_load
    from bench.loop_levels import LevelRun
    from bench.methods import Method

    calls = []

    def measure(engine, method, workload, streams, max_new_tokens, gated=True, per_stream=1):
        calls.append((streams, method.spelling))
        return LevelRun(method.spelling, streams, 1.0, {len(calls): 2}, {len(calls): 1.0}, [stats(0, 2, 10.0)], {})

    monkeypatch.setattr(loop_load, "measure_level", measure)
    methods = [Method("incremental", "engine", SpeculationOptions(mode="incremental")), Method("tree", "engine", TREE)]
    figures = loop_load.run_levels(None, methods, [], [1, 4], argparse.Namespace(repeats=2, max_new_tokens=4,
                                                                                  gate_ab=False, per_stream=1))
    assert calls == [(s, m) for s in (1, 4) for _ in range(2) for m in ("incremental", "tree")]
    assert [(f["streams"], f["method"], f["repeats"]) for f in figures] == [
        (1, "incremental", 2), (1, "tree", 2), (4, "incremental", 2), (4, "tree", 2)]


# -- An SSM's view of a request (ssms[].context_tokens). ---------------------------------------


def windowed_loop(models, window: int | None) -> EngineLoop:
    loop = paged_loop(models)
    loop.executor.drafters[0].context_tokens = window
    return loop


@pytest.mark.parametrize("window", [None, 1, 4, 40])
def test_a_windowed_ssm_keeps_the_output_the_targets_own(models, window):
    """fp32 greedy output through the loop equals the target's own greedy decoding whatever the SSM
    reads of each request; with a window its state holds the window and the tokens after it."""
    loop = windowed_loop(models, window)
    prompts = [list(range(3, 33)), [5, 9, 2, 7] * 5, list(range(60, 66))]
    ids = [loop.submit(GenerationRequest(p, 12, speculation=TREE)) for p in prompts]
    drafter, side = loop.executor.drafters[0], loop.executor.draft_side
    for _ in range(4):  # past the prompts and the first drafts
        loop.step()
    for request_id, prompt in zip(ids, prompts):
        held = side.states[request_id][0].length  # the SSM's committed tokens (its levels rolled back)
        committed = len(loop.requests[request_id].session.committed)
        start = side.starts[(request_id, 0)]
        assert start == (0 if window is None else max(0, len(prompt) + 1 - window))
        assert held in (committed - start, committed - start - 1)  # the root may be fed at the next draft
    outputs = drain(loop, ids, {i: [] for i in ids})
    assert [outputs[i] for i in ids] == [reference_greedy(models[0], p, 12) for p in prompts]
    assert not side.starts and pools_whole(loop)


def test_a_windowed_first_draft_is_the_draft_of_the_windows_tokens_alone(models):
    """The SSM's first draft over a window of the context is the draft it makes over those tokens as a
    whole request: the window changes what it reads, nothing else."""
    committed = list(range(3, 40))
    assignments = plan_proposers(("ssm", "suffix"), (True, False), SpeculationOptions(expansion=(2, 2, 1),
                                                                                        proposers=("ssm",)))
    job = lambda request_id, tokens: DraftJob(request_id, tuple(tokens), assignments)
    windowed, whole = windowed_loop(models, 8).executor.draft_side, windowed_loop(models, None).executor.draft_side
    drafted = windowed.draft([job(0, committed)])[0][0].proposal
    alone = whole.draft([job(0, committed[-8:])])[0][0].proposal
    assert drafted.tree.tokens.tolist() == alone.tree.tokens.tolist()
    assert drafted.tree.parents.tolist() == alone.tree.parents.tolist()
    assert len(drafted.tree.tokens) > 1  # it did draft
