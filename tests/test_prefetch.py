"""Asynchronous SSM prefetch (engine.prefetch, actors.ssm): trees drafted ahead during verification.

Without Ray: the pure guesses, the generator derivation, and that a tree drafted ahead is the tree
the normal path drafts (same proposal, same KV entries, same shape history) while the state
otherwise stays as it was. In-process (a thread drafts ahead) and served (``ray``): fp32 greedy
output equals the target's own with prefetch on, hits happen where the SSM is the target itself,
a seeded sampled request gives the same tokens with prefetch on and off (a negative control, taking
any prepared tree, fails it); served, bad values are INVALID_ARGUMENT.
"""

from __future__ import annotations

import copy

import grpc
import pytest
import torch

from engine import kv
from engine.draft import DraftSpec, ModelDrafter
from engine.kv_pool import PagedSequence
from engine.paged_models import PagedDrafter, paged_parts
from engine.prefetch import PrefetchJob, best_path, install, path_guesses, prefetch, record_outcome
from engine.sampling import SamplingParams, make_generator, stream_seed
from engine.shape import TreeCost
from engine.step import Assignment
from engine.tree import TokenTree
from serving_fixtures import (ingress, local_engine, ray_session, serving, tiny_args,  # noqa: F401  (fixtures)
                              tiny_models)
from tiny_models import tiny_model

SLOW_FLAT = TreeCost(((1, 1e6), (64, 1e6)))  # so slow a pass that no machine pause changes a size decision


def tree(parents: list[int], tokens: list[int] | None = None) -> TokenTree:
    tokens = tokens if tokens is not None else list(range(len(parents)))
    return TokenTree(torch.tensor(tokens), torch.tensor(parents))


# --- pure pieces ----------------------------------------------------------------------------

BEST_PATHS = [  # (parents, the first-child path from the root)
    ([-1], []),
    ([-1, 0, 0, 1, 3, 1], [1, 3, 4]),  # the docstring's example
    ([-1, 0, 1, 2], [1, 2, 3]),  # a chain
    ([-1, 0, 0, 2], [1]),  # the first child is a leaf; its sibling's subtree is not followed
]


@pytest.mark.parametrize("parents,path", BEST_PATHS)
def test_best_path_follows_first_children(parents, path):
    assert best_path(tree(parents)) == path


def logits_from(rows: list[dict[int, float]], vocab: int = 8) -> torch.Tensor:  # -> [G, V]
    """Logits whose softmax puts the given probabilities on the given tokens (the rest shares what is left)."""
    out = torch.empty(len(rows), vocab)
    for i, row in enumerate(rows):
        rest = (1.0 - sum(row.values())) / (vocab - len(row))
        out[i] = torch.log(torch.tensor([row.get(t, rest) for t in range(vocab)]))
    return out


def test_path_guesses_worked_example():
    """The docstring's example: root r=7 -> a=1 -> b=2; at r: a 0.5, z=6 0.3; after a: b 0.6, x=3 0.3;
    after b: y=4 0.6."""
    t = tree([-1, 0, 1], [7, 1, 2])
    logits = logits_from([{1: 0.5, 6: 0.3}, {2: 0.6, 3: 0.3}, {4: 0.6}])
    assert path_guesses([5, 7], t, [1, 2], logits, 3) == [(5, 7, 1, 2, 4), (5, 7, 6), (5, 7, 1, 3)]
    assert path_guesses([5, 7], t, [1, 2], logits, 1) == [(5, 7, 1, 2, 4)]


def test_the_whole_path_comes_first_however_unlikely_and_cuts_follow_by_score():
    """Path a->b->c (a at 0.9); cuts at the root (score 0.05), after a (0.9 * 0.5) and after b
    (0.9 * 0.1 * 0.9): the whole path (score 0.9 * 0.1 * 0.1 * 0.2) is still first, then the cuts by score."""
    t = tree([-1, 0, 1, 2], [7, 1, 2, 3])
    logits = logits_from([{1: 0.9, 0: 0.05}, {2: 0.1, 5: 0.5}, {3: 0.1, 6: 0.9}, {4: 0.2}])
    assert path_guesses([7], t, [1, 2, 3], logits, 4) == [(7, 1, 2, 3, 4), (7, 1, 5), (7, 1, 2, 6), (7, 0)]
    assert path_guesses([7], t, [1, 2, 3], logits, 2) == [(7, 1, 2, 3, 4), (7, 1, 5)]


def test_path_guesses_exclude_the_nodes_children():
    """At a node with children b and c in the tree, the guess is the best token that is neither (at
    the root too: a and d are its children)."""
    t = tree([-1, 0, 1, 1, 0], [7, 1, 2, 3, 4])
    logits = logits_from([{1: 0.5, 4: 0.3, 5: 0.1}, {2: 0.4, 3: 0.35, 6: 0.2}])
    assert path_guesses([7], t, [1], logits, 4) == [(7, 1, 6), (7, 5)]


def test_stream_seeds_do_not_collide_where_the_old_formula_did():
    """seed * 1_000_003 + stream made (1, 1_000_003) and (2, 0) one stream; positions are part of the key."""
    assert stream_seed(1, 1_000_003, 0) != stream_seed(2, 0, 0)
    seeds = {stream_seed(seed, stream, position) for seed in range(20) for stream in range(4) for position in range(20)}
    assert len(seeds) == 20 * 4 * 20
    assert torch.equal(make_generator(3, 1, 9).get_state(), make_generator(3, 1, 9).get_state())


def test_a_job_stops_once_the_wanted_outcome_is_known():
    job = PrefetchJob(base=2, spec=DraftSpec((1,)))
    job.offer([(1, 2, 3), (1, 2, 4), (1, 5)])
    assert job.next_guess() == (1, 2, 3)
    job.want((1, 5))  # the verdict: the prefetch drafts that one next, then stops
    assert job.next_guess() == (1, 5)
    job.want((1, 9))  # an outcome nobody guessed: stop at once
    assert job.next_guess() is None


def test_saved_entries_are_moved_aside_and_back_and_their_blocks_return():
    """PagedSequence.save/restore record moves (applied by the next forward) and hold a block of
    their own in between: entries 3..5 of a sequence in blocks of 4 go to a fresh block and back."""
    from engine.kv_pool import BlockPool

    pool = BlockPool(num_blocks=8, block_size=4)
    sequence = PagedSequence(pool)
    sequence.append(6)
    sequence.keep(list(range(6)))
    pool.take_moves()
    held = pool.num_free
    saved = sequence.save(3)
    aside = saved.slots(pool.block_size)
    assert saved.count == 3 and len(saved.blocks) == 1 and pool.num_free == held - 1
    assert torch.equal(pool.take_moves(), torch.stack([sequence.slots(3, 6), aside]))
    sequence.truncate(3)
    sequence.restore(3, saved)
    assert sequence.length == 6 and pool.num_free == held
    assert torch.equal(pool.take_moves(), torch.stack([aside, sequence.slots(3, 6)]))
    sequence.drop(sequence.save(4))  # saved, then not wanted: its block goes back
    assert pool.num_free == held


# --- settings -------------------------------------------------------------------------------


@pytest.mark.parametrize("batching", [True, False])
def test_prefetch_in_the_config_is_bounded(tiny_args, batching):
    from settings.config import EngineConfig

    server = {**tiny_args["server"], "batching": {**tiny_args["server"]["batching"], "enabled": batching}}
    args = {**tiny_args, "server": server, "speculation": {**tiny_args["speculation"], "prefetch": 2}}
    assert EngineConfig.model_validate(args).speculation.prefetch == 2
    with pytest.raises(ValueError, match="less than or equal to 8"):
        EngineConfig.model_validate({**args, "speculation": {"prefetch": 9}})


@pytest.mark.parametrize("cpus,error", [([], "at least one CPU"), ([-1], "at least one CPU"), ([0], None),
                                        (None, None)])
def test_cpu_affinity_is_checked(cpus, error):
    from settings.config import ActorOptions

    if error is None:
        assert ActorOptions(cpu_affinity=cpus).cpu_affinity == cpus
    else:
        with pytest.raises(ValueError, match=error):
            ActorOptions(cpu_affinity=cpus)


def test_pinning_to_a_cpu_this_process_lacks_is_a_clear_error():
    import os

    from actors.common import pin_process

    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match=r"cpu_affinity \[100000\]: this machine has CPUs 0\.\."):
        pin_process([100000])
    assert os.sched_getaffinity(0) == before


def test_pinning_reaches_threads_that_already_run():
    """Linux affinity is per thread: a thread started before the pin is pinned too (Ray's do)."""
    import os
    import threading

    from actors.common import pin_process

    before, release = sorted(os.sched_getaffinity(0)), threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        pin_process(before[:1])
        assert os.sched_getaffinity(thread.native_id) == set(before[:1]) == os.sched_getaffinity(0)
    finally:
        pin_process(before)
        release.set()
        thread.join()
    assert os.sched_getaffinity(0) == set(before)


# --- a tree drafted ahead is the normal path's tree ---------------------------------------

SPECS = [  # (name, spec): deterministic and drawn children, a dynamic tree, a cost-aware shape
    ("top_k", DraftSpec((2, 2, 1))),
    ("sampled", DraftSpec((2, 1, 1), "sampled", SamplingParams(temperature=0.8, seed=5))),
    ("without_replacement", DraftSpec((3, 1), "sampled_without_replacement", SamplingParams(temperature=1.2, seed=6))),
    ("confidence", DraftSpec((2, 2, 2), min_confidence=0.05)),
    ("cost_aware", DraftSpec((2, 1), cost=SLOW_FLAT, max_nodes=16)),
    ("cost_aware_overlapped", DraftSpec((2, 1), cost=SLOW_FLAT, max_nodes=16)),  # after prefetch hits
]


def drafted_through(drafter: ModelDrafter, state, steps: list[list[int]], assignment: Assignment, hits: int):
    """Draft at each committed prefix in turn; before the last, record ``hits`` prefetch hits (as the
    SSM actor does after each step whose tree was ready). Returns the last proposal."""
    for index, step in enumerate(steps):
        if index == len(steps) - 1:
            for _ in range(hits):
                record_outcome(drafter, state, True)
        drafted = drafter.draft(state, step, assignment.spec, assignment.generator(len(step)))
    return drafted


@pytest.fixture(scope="module")
def ssm():
    return tiny_model("llama", vocab_size=61, layers=2, seed=3, hidden=32)


def make_drafter(kind: str, ssm, name: str) -> ModelDrafter:
    """A plain drafter (DynamicCache) or a paged one over a pool of its own (blocks of 4 slots, so
    entries cross block boundaries). Its SSM forwards cost what they cost by the table below, not by
    the clock: which nodes a cost-aware level expands decides the batch their entries are computed
    in, and the next draft reuses the accepted ones, so two drafters agree bit for bit only if they
    expand the same nodes."""
    if kind == "plain":
        drafter = ModelDrafter(ssm, 0, name)
    else:
        pool, batcher = paged_parts(ssm, tokens=512, block_size=4)
        drafter = PagedDrafter(ssm, 0, name, pool, batcher)
    drafter.forward_ms.update({1: 1.0, 2: 1.5, 4: 2.5})
    drafter._time_forward = lambda began, tokens: None
    return drafter


def entries(drafter: ModelDrafter, state) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (keys, values) of the state's committed entries."""
    if isinstance(state, PagedSequence):
        storage = drafter.batcher.model.runner.storage
        storage.move(drafter.pool.take_moves())  # what the next forward would apply first
        slots = state.slots(0, state.length)
        return [(k[:, slots].clone(), v[:, slots].clone()) for k, v in zip(storage.keys, storage.values)]
    return [(layer.keys[0, :, :].transpose(0, 1).clone(), layer.values[0].transpose(0, 1).clone())
            for layer in state.layers]


def length(state) -> int:
    return state.length if isinstance(state, PagedSequence) else kv.cache_length(state)


def same_entries(a, b) -> bool:
    return all(torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(a, b))


def same_proposal(a, b) -> bool:
    same_q = (a.draws.q is None and b.draws.q is None) or torch.equal(a.draws.q, b.draws.q)
    return (torch.equal(a.tree.tokens, b.tree.tokens) and torch.equal(a.tree.parents, b.tree.parents)
            and torch.equal(a.draws.node, b.draws.node) and same_q)


@pytest.mark.parametrize("kind", ["plain", "paged"])
@pytest.mark.parametrize("name,spec", SPECS, ids=[name for name, _ in SPECS])
def test_a_prepared_tree_is_the_tree_drafted_after_the_verdict(ssm, name, spec, kind):
    """For every guessed outcome: the prepared proposal equals the one a second drafter makes from
    the same history at that outcome; installing it leaves the same KV entries and shape history.
    Meanwhile the state is as before: cache entries and history untouched. Paged: the prepared
    entries' blocks all go back once the others are dropped."""
    assignment, committed = Assignment(0, spec), [4, 9, 17, 3, 22]
    hits = 3 if name.endswith("overlapped") else 0
    ahead = make_drafter(kind, ssm, "ahead")
    state = ahead.new_state()  # two drafts, so a cost-aware history has scored a tree
    drafted = drafted_through(ahead, state, [committed[:3], committed], assignment, hits)
    assert not hits or ahead.shape_of(state).overlap > 0.5
    before, history = entries(ahead, state), copy.deepcopy(ahead.shape_of(state))
    job = PrefetchJob(len(committed), spec)
    prefetch(ahead, state, committed, drafted.tree, assignment.generator, 8, job)  # every cut
    assert same_entries(entries(ahead, state), before) and length(state) == len(committed)
    assert ahead.shape_of(state) == history
    assert len(job.guesses) == len(best_path(drafted.tree)) + 1  # the whole path, cuts at depth 0..
    assert min(len(outcome) for outcome in job.guesses) == len(committed) + 1  # the cut at the root
    prepared_trees = {outcome: job.take(outcome) for outcome in job.guesses}
    for index, (outcome, prepared) in enumerate(prepared_trees.items()):
        assert outcome[:len(committed)] == tuple(committed) and len(outcome) > len(committed)
        normal = make_drafter(kind, ssm, "normal")
        reference = normal.new_state()
        drafted_through(normal, reference, [committed[:3], committed], assignment, hits)
        expected = normal.draft(reference, list(outcome), spec, assignment.generator(len(outcome)))
        assert same_proposal(prepared.proposal, expected), f"outcome {index} of {name}"
        assert prepared.history == normal.shape_of(reference)
        if index == 0:  # install the first: the state is the normal path's
            job.drop(ahead, state, keep=prepared)
            install(ahead, state, job, prepared)
            assert same_entries(entries(ahead, state), entries(normal, reference)) and length(state) == len(outcome)
            assert ahead.shape_of(state) == normal.shape_of(reference)
    if kind == "paged":
        assert ahead.pool.num_free == ahead.pool.num_blocks - len(state.blocks)


def test_a_paged_prefetch_without_a_free_block_stops_and_leaves_the_state_as_it_was(ssm):
    """Every block of the pool is reserved by the request itself: saving the root's entry finds no
    unreserved block, so nothing is prepared, nothing is raised, and the state is untouched."""
    spec = DraftSpec((2, 2, 1))
    pool, batcher = paged_parts(ssm, tokens=16, block_size=4)
    drafter, committed = PagedDrafter(ssm, 0, "ssm", pool, batcher), [4, 9, 17, 3, 22]
    state = drafter.new_state(reserve_tokens=16)
    drafted = drafter.draft(state, committed, spec, make_generator(0, 1, 5))
    before, job = entries(drafter, state), PrefetchJob(len(committed), spec)
    prefetch(drafter, state, committed, drafted.tree, Assignment(0, spec).generator, 2, job)
    assert job.guesses == [] and same_entries(entries(drafter, state), before) and state.length == len(committed)
    state.release()
    assert pool.counts() == (pool.num_blocks, pool.num_blocks, pool.num_blocks)


def test_a_released_drafter_state_drops_a_prefetched_history(ssm):
    spec = SPECS[-1][1]
    drafter = ModelDrafter(ssm, 0, "ssm")
    state, committed = drafter.new_state(), [4, 9, 17]
    drafted = drafter.draft(state, committed, spec, make_generator(0, 1, 3))
    prefetch(drafter, state, committed, drafted.tree, Assignment(0, spec).generator, 2, PrefetchJob(3, spec))
    drafter.release(state)
    assert drafter.shape_of(state) is None


# --- in-process ---------------------------------------------------------------------------

PROMPTS = ["def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)", "Hello wörld, speculative decoding!"]


@pytest.fixture(scope="module")
def target_model(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prefetching_engine(tiny_args, tiny_models):
    """The in-process engine with SSM "self" (the target itself: its guesses hit) and "ssm-a" (an
    independent tiny model), fp32, no suffix proposer."""
    from cluster.build import build_engine
    from settings.config import EngineConfig

    args = copy.deepcopy(tiny_args)
    args["ssms"] = [{"name": "self", "source": str(tiny_models["target"])},
                    {"name": "ssm-a", "source": str(tiny_models["ssm-a"])}]
    args["suffix"] = None
    return build_engine(EngineConfig.model_validate(args))


def in_process(engine, prompt: str, prefetch_count: int, ssms=None, children: str = "top_k",
               sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 32):
    from engine.requests import GenerationRequest, SpeculationOptions

    options = SpeculationOptions(mode="tree", expansion=(2, 2, 1), max_tree_nodes=32, children=children,
                                 prefetch=prefetch_count, adaptive=False, proposers=ssms)
    ids = tuple(engine.tokenizer.encode(prompt))
    return engine.generate(GenerationRequest(ids, max_new_tokens, sampling, options))


@pytest.mark.parametrize("ssms", [("self", "ssm-a"), ("ssm-a",)])
def test_in_process_greedy_with_prefetch_is_the_targets_own_output(prefetching_engine, target_model, ssms):
    """A thread drafts ahead while this one verifies: fp32 tokens equal the target's ``generate``;
    with the target as SSM every step after the first is a hit."""
    hits = steps = ran = 0
    for prompt in PROMPTS:
        ids = prefetching_engine.tokenizer.encode(prompt)
        result = in_process(prefetching_engine, prompt, 2, ssms=ssms)
        reference = target_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids):]
        assert list(result.token_ids) == reference.tolist()
        hits, steps = hits + result.stats.prefetch_hits, steps + result.stats.target_steps - 2
        ran += result.stats.prefetch_hits + result.stats.prefetch_misses
    assert ran > 0
    if "self" in ssms:
        assert hits >= steps > 0, (hits, steps)


@pytest.mark.parametrize("children", ["top_k", "sampled"])
def test_in_process_seeded_sampled_output_is_the_same_with_prefetch_on_and_off(prefetching_engine, children):
    """Seeded sampling (fixed shapes): the same tokens with prefetch 0, 3 and 0 again; prefetch ran."""
    sampling = SamplingParams(temperature=0.9, seed=7)
    runs = [in_process(prefetching_engine, PROMPTS[0], n, children=children, sampling=sampling, max_new_tokens=40)
            for n in (0, 3, 0)]
    assert [list(r.token_ids) for r in runs[1:]] == [list(runs[0].token_ids)] * 2
    assert [r.stats.prefetch_hits + r.stats.prefetch_misses > 0 for r in runs] == [False, True, False]


# --- served ------------------------------------------------------------------------------

APP = "specinfer-prefetch"


@pytest.fixture(scope="module")
def prefetch_app(serving, tiny_args, tiny_models):  # noqa: F811
    """(gRPC address, Serve handle) of an app without batching that prefetches 2 outcomes per SSM:
    SSM "self" is the target itself (its best path is the target's, so its guesses hit), "ssm-a" an
    independent tiny model (its guesses mostly miss). No suffix proposer: the accepted path is never
    longer than the SSMs' trees."""
    from ray import serve

    from cluster.serve_app import app_builder
    from cluster.serve_client import Client

    args = copy.deepcopy(tiny_args)
    args["ssms"] = [{"name": "self", "source": str(tiny_models["target"])},
                    {"name": "ssm-a", "source": str(tiny_models["ssm-a"])}]
    args["suffix"] = None
    args["speculation"] = {**args["speculation"], "prefetch": 2}
    args["server"] = {**args["server"], "batching": {"enabled": False}}
    serve.run(app_builder(args), name=APP, route_prefix="/prefetch", blocking=False)
    with Client(serving, APP) as client:
        client.wait_ready(300)
    yield serving, serve.get_app_handle(APP)
    serve.delete(APP)


def held(handle) -> dict[str, int]:
    import ray

    actors = handle.actors.remote().result()
    return {"ingress": handle.num_active.remote().result(),
            **dict(zip(actors, ray.get([a.num_requests.remote() for a in actors.values()])))}


@pytest.mark.ray
@pytest.mark.parametrize("ssms", [("self", "ssm-a"), ("ssm-a",)])
def test_served_greedy_with_prefetch_is_the_targets_own_output(prefetch_app, local_engine, target_model, ssms):
    """fp32: tokens equal the target's ``generate``; with the target as SSM the guesses hit."""
    from cluster.serve_client import Client, build_request
    from serving_fixtures import wait_until
    address, handle = prefetch_app
    hits = misses = steps = 0
    with Client(address, APP) as client:
        for prompt in PROMPTS:
            ids = local_engine.tokenizer.encode(prompt)
            response = client.generate(build_request(prompt, max_new_tokens=32, ssms=ssms), timeout=300)
            reference = target_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids):]
            assert list(response.token_ids) == reference.tolist()
            hits, misses = hits + response.stats.prefetch_hits, misses + response.stats.prefetch_misses
            steps += response.stats.target_steps - 1
    assert hits + misses <= len(ssms) * steps and hits + misses >= steps - len(PROMPTS)  # every step after the first
    if "self" in ssms:
        assert hits >= steps - len(PROMPTS), (hits, misses, steps)  # the target's own guesses: every one hits
    assert wait_until(lambda: not any(held(handle).values()), timeout_s=60), held(handle)


@pytest.mark.ray
@pytest.mark.parametrize("children", ["top_k", "sampled"])
def test_a_seeded_sampled_request_gives_the_same_tokens_with_prefetch_on_and_off(prefetch_app, children):
    """Each draft's generator comes from (seed, proposer, committed length): a tree drafted ahead
    draws what the tree drafted after the verdict draws, so the tokens cannot depend on prefetch."""
    from cluster.serve_client import Client, build_request

    address, _ = prefetch_app
    outputs, stats = {}, {}
    with Client(address, APP) as client:
        for prefetch_count in (0, 3, 0):
            request = build_request(PROMPTS[0], max_new_tokens=40, temperature=0.9, seed=7, adaptive=False,
                                    children=children, prefetch=prefetch_count)
            response = client.generate(request, timeout=300)
            outputs.setdefault(prefetch_count, []).append(list(response.token_ids))
            stats[prefetch_count] = response.stats
    assert outputs[0][0] == outputs[0][1] == outputs[3][0]
    assert stats[0].prefetch_hits == stats[0].prefetch_misses == 0
    assert stats[3].prefetch_hits + stats[3].prefetch_misses > 0


@pytest.mark.ray
def test_served_prefetch_with_continuous_batching_is_the_targets_own_output(serving, ingress, local_engine,
                                                                             target_model):
    """The shared app batches (paged pools, packed forwards): two concurrent greedy requests with
    prefetch 2 get the target's own tokens, their SSMs drafted ahead (in the packed forwards of
    both), and every pool block comes back, the prepared trees' included."""
    import threading

    import ray

    from cluster.serve_client import Client, build_request
    from serving_fixtures import batch_hold, remote_hold, wait_until
    from tests.test_serving import pools_settled

    verifier = ingress.actors.remote().result()["verifier"]
    replies: list = [None] * len(PROMPTS)

    def ask(index: int) -> None:
        with Client(serving) as client:
            replies[index] = client.generate(build_request(PROMPTS[index], max_new_tokens=32, prefetch=2), timeout=300)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    with batch_hold(remote_hold(verifier), 2):  # both prefills share a forward: the two run side by side
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    for prompt, reply in zip(PROMPTS, replies):
        ids = local_engine.tokenizer.encode(prompt)
        reference = target_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids):]
        assert list(reply.token_ids) == reference.tolist()
    assert sum(r.stats.prefetch_hits + r.stats.prefetch_misses for r in replies) > 0
    assert wait_until(lambda: pools_settled(ingress), timeout_s=60)


@pytest.mark.ray
def test_bad_prefetch_values_are_invalid_argument(prefetch_app):
    from cluster.serve_client import Client, build_request

    address, _ = prefetch_app
    with Client(address, APP) as client:
        with pytest.raises(grpc.RpcError) as error:
            client.generate(build_request(PROMPTS[0], max_new_tokens=4, prefetch=9), timeout=60)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "speculation.prefetch" in error.value.details() and "[0, 8]" in error.value.details()


@pytest.mark.ray
def test_the_prefetch_bench_runs_its_methods_interleaved_against_a_server(prefetch_app, tmp_path):
    """bench/prefetch.py's client side on the tiny app: rows per prompt and method, in turn; the
    summary, table and plot; unpinned actors may use every CPU."""
    import os

    from bench.prefetch import affinities, markdown, outputs_equal, plot, run, summarize
    from bench.workloads import EncodedPrompt, Prompt

    address, _ = prefetch_app
    prompts = [EncodedPrompt(Prompt(f"p{i}", text), ()) for i, text in enumerate(PROMPTS)]
    rows = run(address, prompts, ["pinned-off", "pinned-on"], 12, 2, 4, app=APP)
    assert [(r.prompt_id, r.method) for r in rows] == [("p0", "pinned-off"), ("p0", "pinned-on"),
                                                      ("p1", "pinned-off"), ("p1", "pinned-on")]
    assert all(r.hits + r.misses == 0 for r in rows if r.method == "pinned-off")
    assert sum(r.hits for r in rows if r.method == "pinned-on") > 0  # SSM "self" guesses the target's path
    summary = summarize(rows)  # its arithmetic: test_the_prefetch_summary_sums_over_prompts
    assert summary["pinned-on"]["hit_rate"] > 0 and summary["pinned-off"]["hit_rate"] is None
    assert outputs_equal(rows) == {"pinned-off": "2/2", "pinned-on": "2/2"}  # fp32 greedy
    placements = affinities(APP)
    assert placements["verifier"] == sorted(os.sched_getaffinity(0)) and set(placements) >= {"ssm/self", "merge"}
    table = markdown({"started": "now", "setup": "tiny", "summary": summary, "placements": {"unpinned": placements},
                      "outputs_equal_pinned_off": outputs_equal(rows)})
    assert table.count("\n| pinned-") == 2
    plot(summary, tmp_path / "prefetch.png")
    assert (tmp_path / "prefetch.png").stat().st_size > 0


def test_the_prefetch_summary_sums_over_prompts():
    """Per method: tokens over latency, per-step figures weighted by each prompt's verify steps,
    decode tokens/s after the prefill, hit rate; both speeds against pinned-off."""
    from bench.prefetch import Row, summarize

    def row(prompt_id, method, latency_ms, step_ms, draft_ms, verify_ms, hits, misses, saved_ms, tree_nodes):
        tokens, steps = (10, 5) if prompt_id == "p0" else (6, 3)  # 4 and 2 verify steps after the prefill
        return Row(prompt_id, method, tokens, steps, latency_ms, step_ms, draft_ms, verify_ms, hits, misses, saved_ms,
                   tree_nodes, ())

    rows = [row("p0", "pinned-off", 1000.0, 100.0, 40.0, 50.0, 0, 0, 0.0, 3.0),
            row("p1", "pinned-off", 600.0, 200.0, 60.0, 120.0, 0, 0, 0.0, 1.0),
            row("p0", "pinned-on", 500.0, 50.0, 10.0, 30.0, 3, 1, 42.0, 3.0),
            row("p1", "pinned-on", 300.0, 100.0, 20.0, 60.0, 1, 1, 18.0, 2.0)]
    common = {"prompts": 2, "new_tokens": 16, "tokens_per_step": 2.0}
    expected = {
        "pinned-off": {**common, "tokens_per_s": 10.0, "step_ms": 800 / 6, "draft_ms_per_step": 280 / 6,
                       "verify_ms_per_step": 440 / 6, "decode_tokens_per_s": 17.5, "tree_nodes": 2.0,
                       "prefetch_hits": 0, "prefetch_misses": 0, "hit_rate": None, "saved_ms_per_step": 0.0,
                       "tokens_per_s_vs_pinned_off": 1.0, "decode_tokens_per_s_vs_pinned_off": 1.0},
        "pinned-on": {**common, "tokens_per_s": 20.0, "step_ms": 400 / 6, "draft_ms_per_step": 80 / 6,
                      "verify_ms_per_step": 40.0, "decode_tokens_per_s": 35.0, "tree_nodes": 2.5,
                      "prefetch_hits": 4, "prefetch_misses": 2, "hit_rate": 4 / 6, "saved_ms_per_step": 10.0,
                      "tokens_per_s_vs_pinned_off": 2.0, "decode_tokens_per_s_vs_pinned_off": 2.0}}
    summary = summarize(rows)
    assert list(summary) == list(expected)
    for method, figures in expected.items():
        assert summary[method] == pytest.approx(figures), method


def test_a_pinned_placement_pins_the_ssm_and_the_verifier_only():
    from bench.prefetch import placed_args
    from settings.config import EngineConfig

    app = {"target": {"name": "t", "source": "t"}, "ssms": [{"name": "s", "source": "s"}],
           "server": {"ssm_actor": {"num_cpus": 0.5}}, "speculation": {"mode": "tree"}}
    pinned = EngineConfig.model_validate(placed_args(app, True, (1, 0), 2, "float32"))
    assert pinned.server.ssm_actor.cpu_affinity == [1] and pinned.verifier.actor.cpu_affinity == [0]
    assert pinned.server.merge_actor.cpu_affinity is None and pinned.server.ssm_actor.torch_threads == 1
    assert pinned.speculation.prefetch == 2 and not pinned.server.batching.enabled and pinned.dtype == "float32"
    assert pinned.suffix.max_cached_requests == 0  # a prompt's second method is not handed the first's answer
    unpinned = EngineConfig.model_validate(placed_args(app, False, (1, 0), 2, None))
    assert unpinned.server.ssm_actor.cpu_affinity is None and unpinned.verifier.actor.cpu_affinity is None
