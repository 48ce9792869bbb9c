"""Tensor-parallel verification (DeepSpeed AutoTP, 2 rank actors over gloo on CPU) against tp=1,
one request per forward and with continuous batching (the paged pool's storage sharded on the ranks).

fp32 throughout: tp=2 all-reduces partial sums, so its logits differ from tp=1 by float rounding
only (about 1e-6 here); greedy token ids must be identical, in-process and through gRPC.
"""

from __future__ import annotations

import glob
import inspect
import threading
import time

import pytest
import torch

from engine.requests import GenerationRequest, SpeculationOptions
from engine.kv_pool import PagedSequence
from engine.tree import TokenTree
from serving_fixtures import (loop_hold, own_app, ray_session, serving, tiny_args,  # noqa: F401  (fixtures)
                              tiny_models, wait_until)
from tests.test_batching import item_counts, run_loop
from tests.tiny_models import reference_greedy

pytestmark = pytest.mark.ray

pytest.importorskip("deepspeed")

TP_VERIFIER = {"tensor_parallel_size": 2, "collective_timeout_s": 20.0, "actor": {"num_cpus": 0.25, "torch_threads": 2}}


def tp_args(args: dict, batching: bool = False) -> dict:
    """``args`` with a 2-rank verifier, continuous batching on or off."""
    server = {**args["server"], "batching": {**args["server"]["batching"], "enabled": batching}}
    return {**args, "verifier": TP_VERIFIER, "server": server}


@pytest.fixture(scope="module")
def engines(ray_session, tiny_args):
    """(tp=1 engine, tp=2 engine) on the same tiny target and SSMs; the tp=2 ranks stop at the end."""
    from cluster.build import build_engine
    from settings.config import EngineConfig

    single = build_engine(EngineConfig.model_validate(tiny_args))
    parallel = build_engine(EngineConfig.model_validate(tp_args(tiny_args)))
    yield single, parallel
    parallel.target.shutdown()


TREES = [  # (tokens, parents): a chain, a bushy tree, a root-only tree
    ([5, 6, 7, 8], [-1, 0, 1, 2]),
    ([5, 6, 7, 8, 9, 10, 11], [-1, 0, 0, 1, 1, 2, 5]),
    ([42], [-1]),
]


@pytest.mark.parametrize("tokens,parents", TREES)
def test_tree_logits_match_single_process(engines, tokens, parents):
    """Prefill, a tree, a commit of a non-first branch, then a second tree over the shards' caches."""
    single, parallel = engines
    prompt = list(range(60, 90))
    tree = TokenTree(torch.tensor(tokens), torch.tensor(parents))
    states = [single.target.new_state(), parallel.target.new_state()]
    first = [e.target.prefill(s, prompt) for e, s in zip(engines, states)]
    assert torch.allclose(first[0], first[1], atol=1e-4, rtol=0)
    logits = [e.target.forward_tree(s, tree).cpu() for e, s in zip(engines, states)]  # [N, V]
    assert logits[1].shape == (len(tokens), single.target.model.config.vocab_size)
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4
    path = tuple(range(len(tokens)))[:1] + ((len(tokens) - 1,) if len(tokens) > 1 else ())
    for engine, state in zip(engines, states):
        engine.target.commit(state, len(prompt), path)
    assert states[0].length == states[1].length == len(prompt) + len(path)
    again = [e.target.forward_tree(s, tree).cpu() for e, s in zip(engines, states)]
    assert (again[0] - again[1]).abs().max().item() < 1e-4


CASES = [  # (prompt, max_new_tokens, speculation)
    (list(range(40, 60)), 40, SpeculationOptions(expansion=(2, 2, 1))),
    (list(range(100, 104)), 33, SpeculationOptions(mode="sequence", sequence_depth=3)),
    ([7, 7, 7, 9, 7, 7, 7], 25, SpeculationOptions(expansion=(3, 1, 1, 1), proposers=("suffix",))),
    (list(range(70, 120)), 17, SpeculationOptions(mode="incremental")),
]


@pytest.mark.parametrize("prompt,max_new_tokens,speculation", CASES)
def test_greedy_generation_identical(engines, tiny_models, prompt, max_new_tokens, speculation):
    from transformers import AutoModelForCausalLM

    single, parallel = engines
    request = GenerationRequest(tuple(prompt), max_new_tokens, speculation=speculation)
    expected = reference_greedy(AutoModelForCausalLM.from_pretrained(tiny_models["target"]).eval(), prompt,
                                max_new_tokens)
    assert list(single.generate(request).token_ids) == expected
    assert list(parallel.generate(request).token_ids) == expected


def test_states_are_released_on_every_rank(engines):
    import ray

    _, parallel = engines
    request = GenerationRequest(tuple(range(30, 40)), 8)
    parallel.generate(request)  # the session releases its state on the ranks when it ends
    counts = ray.get([rank.num_states.remote() for rank in parallel.target.group.ranks])
    assert counts == [0, 0]


def test_failed_rank_fails_fast_and_group_is_rebuilt(ray_session, tiny_args):
    """Kill rank 1: the next call fails by the dead rank (not the collective timeout), the old
    request's state is gone, and a new request runs on a rebuilt group with the same output."""
    import ray

    from engine.kv_pool import StateLost
    from actors.rank_group import RanksFailed
    from cluster.build import build_engine
    from settings.config import EngineConfig

    engine = build_engine(EngineConfig.model_validate(tp_args(tiny_args)))
    try:
        target, prompt = engine.target, list(range(50, 70))
        address = ray.get(target.group.ranks[0].group_address.remote())
        before = engine.generate(GenerationRequest(tuple(prompt), 12)).token_ids
        state = target.new_state()
        target.prefill(state, prompt)
        ray.kill(target.group.ranks[1], no_restart=True)
        with pytest.raises(RanksFailed) as failed:
            target.forward_tree(state, TokenTree.root_only(3))
        assert isinstance(failed.value.__cause__, ray.exceptions.RayError), failed.value  # a rank's, not the timeout
        assert not glob.glob(f"/dev/shm/deepspeed_*_{address[0]}_{address[1]}_*")
        with pytest.raises(StateLost):
            target.forward_tree(state, TokenTree.root_only(3))
        assert engine.generate(GenerationRequest(tuple(prompt), 12)).token_ids == before
        assert target.group.generation == 2
    finally:
        engine.target.shutdown()


# -- continuous batching over the ranks ---------------------------------------------------------


def test_every_target_has_the_target_protocol_signatures():
    """Plain, paged (in-process or over ranks: the same class) and tensor-parallel targets."""
    from actors.tensor_parallel import TensorParallelTarget
    from engine.paged_models import PagedTarget
    from engine.target import Target, TargetModel

    methods = [name for name in dir(Target) if not name.startswith("_")]
    assert set(methods) == {"new_state", "prefill", "forward_tree", "commit", "release", "shutdown",
                            "prefill_program", "tree_program"}
    for target in (TargetModel, PagedTarget, TensorParallelTarget):
        for name in methods:
            expected = list(inspect.signature(getattr(Target, name)).parameters)
            assert list(inspect.signature(getattr(target, name)).parameters) == expected, (target, name)


@pytest.fixture(scope="module")
def batched_engines(ray_session, tiny_args):
    """(tp=1, tp=2) in-process engines whose targets are PagedTargets built by the verifier's
    build_target: a PagedModel here, and a TensorParallelPagedModel (pool storage on 2 ranks)."""
    from actors.targets import build_target
    from cluster.build import build_engine
    from engine.generate import SpeculativeEngine
    from settings.config import EngineConfig

    base = build_engine(EngineConfig.model_validate(tiny_args))  # its drafters: 2 SSMs and the suffix proposer
    engines = []
    for args in (tiny_args, tp_args(tiny_args, batching=True)):
        target, _ = build_target(EngineConfig.model_validate(args), expected=lambda: 0)
        engines.append(SpeculativeEngine(target, base.drafters, base.tokenizer, base.eos_ids))
    yield engines
    engines[1].target.shutdown()




BATCHES = [  # concurrent requests: (prompt, max_new_tokens, speculation)
    [(list(range(40, 60)), 30, SpeculationOptions(expansion=(2, 2, 1))),
     (list(range(100, 104)), 21, SpeculationOptions(mode="sequence", sequence_depth=3)),
     ([7, 7, 7, 9, 7, 7, 7], 25, SpeculationOptions(expansion=(3, 1, 1, 1), proposers=("suffix",)))],
    [(list(range(70, 120)), 17, SpeculationOptions(mode="incremental")),
     (list(range(10, 14)), 26, SpeculationOptions(expansion=(2, 1, 1), min_confidence=0.1))],
]


@pytest.mark.parametrize("batch", BATCHES, ids=["three", "two"])
def test_batched_tp2_equals_batched_tp1_and_generate(batched_engines, tiny_models, batch):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_models["target"]).eval()
    expected = [reference_greedy(reference, prompt, n) for prompt, n, _ in batch]
    requests = [GenerationRequest(tuple(prompt), n, speculation=spec) for prompt, n, spec in batch]
    for engine in batched_engines:
        items = item_counts(engine.target.packed)
        outputs, stats = run_loop(engine, requests, joins=[0] * len(requests))  # all in the loop at once
        del engine.target.packed.forward  # the recording goes; the class's forward again
        assert outputs == expected
        assert items[0] == len(batch) and len(items) == len(stats), items  # one pass per iteration, shared
        assert engine.target.pool.counts() == (engine.target.pool.num_blocks,) * 3  # every block came back


def test_packed_logits_tp2_match_tp1(batched_engines):
    """Three sequences in one packed forward, a commit of a non-first branch, then another."""
    from engine.packed import ForwardItem, chain_item
    from engine.tree import ancestor_mask, positions

    models = [engine.target.batcher.model for engine in batched_engines]
    prompts = [list(range(10, 10 + n)) for n in (5, 23, 2)]
    tree = TokenTree(torch.tensor([5, 6, 7, 8, 9, 10, 11]), torch.tensor([-1, 0, 0, 1, 1, 2, 5]))
    results = []
    for model in models:
        sequences = [PagedSequence(model.pool) for _ in prompts]
        logits = model.forward([chain_item(s, p) for s, p in zip(sequences, prompts)])
        for sequence, prompt in zip(sequences, prompts):
            sequence.keep(list(range(len(prompt))))
        for _ in range(2):
            items = [ForwardItem(s, tree.tokens, positions(tree.parents, s.length), ancestor_mask(tree.parents),
                                 torch.arange(tree.size)) for s in sequences]
            logits += model.forward(items)
            for sequence in sequences:
                sequence.keep([0, 2, 5, 6])
        results.append(torch.cat([x.cpu() for x in logits]))
        for sequence in sequences:
            sequence.release()
    assert (results[0] - results[1]).abs().max().item() < 1e-4


def test_killed_rank_fails_batch_fast_and_rebuilt_group_serves(batched_engines, tiny_models):
    """Kill rank 1: the next packed forward fails by the dead rank with RanksFailed; a request of the
    old group then fails alone (StateLost) while a new request in the same forward is served by
    the rebuilt group; every block comes back. Runs last: it restarts the module's group."""
    import ray

    from engine.kv_pool import StateLost
    from actors.rank_group import RanksFailed
    from engine.packed import chain_item

    model = batched_engines[1].target.batcher.model
    pool, group = model.pool, model.group
    address = ray.get(group.ranks[0].group_address.remote())
    old = PagedSequence(pool, reserve_tokens=64)
    model.forward([chain_item(old, list(range(20, 40)))])
    old.keep(list(range(20)))
    ray.kill(group.ranks[1], no_restart=True)
    with pytest.raises(RanksFailed) as failed:
        model.forward([chain_item(old, [5])])
    assert isinstance(failed.value.__cause__, ray.exceptions.RayError), failed.value  # a rank's, not the timeout
    assert not glob.glob(f"/dev/shm/deepspeed_*_{address[0]}_{address[1]}_*")
    old.truncate(old.length)
    new = PagedSequence(pool, reserve_tokens=64)
    lost, served = model.forward([chain_item(old, [5]), chain_item(new, list(range(20, 40)))])
    assert isinstance(lost, StateLost) and isinstance(served, torch.Tensor) and group.generation == 2
    old.release()
    new.release()
    assert pool.counts() == (pool.num_blocks,) * 3
    request = GenerationRequest(tuple(range(50, 70)), 12)
    outputs, _ = run_loop(batched_engines[1], [request, request], joins=[0, 0])
    assert outputs == [list(batched_engines[0].generate(request).token_ids)] * 2


TP2_APP = "specinfer-tp2"


def rank_actors() -> dict[str, str]:
    """Live tensor-parallel rank actors, name (``<prefix>/verifier-<uid>.<generation>/rank-<r>``)
    -> namespace."""
    import ray

    return {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
            if "/rank-" in a["name"]}


@pytest.fixture(scope="module")
def tp2_app(serving, tiny_args):  # noqa: F811
    """(gRPC client, Serve handle, rank names that are not this app's) of a second Serve application
    whose verifier is 2 ranks with batching on. Deleted at the end of the module."""
    others = set(rank_actors())
    with own_app(serving, tp_args(tiny_args, batching=True), TP2_APP, "/tp2") as (client, handle, _):
        yield client, handle, others


def test_grpc_batched_generation_with_tensor_parallel_verifier(serving, tp2_app, tiny_models, tmp_path):
    """Two concurrent requests share packed passes and get the same ids as tp=1 and generate;
    blocks come back."""
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.serve_client import Client, build_request

    client, app, _ = tp2_app
    with Client(serving) as single:
        verifier = app.actors.remote().result()["verifier"]
        target = AutoModelForCausalLM.from_pretrained(tiny_models["target"]).eval()
        tokenizer = AutoTokenizer.from_pretrained(tiny_models["target"])
        prompts = [("def tree(x):", 30), ("speculative inference", 21)]
        requests = [build_request(prompt, max_new_tokens=n) for prompt, n in prompts]
        replies: list = [None] * len(requests)

        def ask(index: int) -> None:
            with Client(serving, application=TP2_APP) as own:
                replies[index] = list(own.generate(requests[index], timeout=120).token_ids)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(requests))]
        with loop_hold(verifier, tmp_path):  # the first pass waits until both are in the loop: the next has both
            for thread in threads:
                thread.start()
            assert wait_until(lambda: app.num_active.remote().result() == len(requests), timeout_s=60)
        for thread in threads:
            thread.join(180)
        assert ray.get(verifier.loop_counters.remote()).largest >= 2
        for reply, request, (prompt, n) in zip(replies, requests, prompts):
            assert reply == list(single.generate(request, timeout=120).token_ids)
            assert reply == reference_greedy(target, tokenizer.encode(prompt), n)
        free, unreserved, total = ray.get(verifier.pool_blocks.remote())
        assert free == unreserved == total


def test_grpc_killed_rank_fails_the_stream_unavailable_and_the_next_request_is_served(serving, tp2_app,
                                                                                       tiny_models, tmp_path):
    """Served: a stream is admitted and frozen before its prefill pass (the verifier's loop calls
    held), so it is certainly in flight when rank 1 is killed; let go, the forward fails on the dead rank, the
    stream ends UNAVAILABLE (not by its deadline: nothing hangs), the next request is served by the
    rebuilt group with the right ids, and every block comes back."""
    import grpc
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.serve_client import build_request

    client, app, others = tp2_app
    verifier = app.actors.remote().result()["verifier"]
    assert client.generate(build_request("warm", max_new_tokens=2), timeout=120).stats.new_tokens == 2
    (rank1,) = [name for name in rank_actors() if name not in others and name.endswith("/rank-1")]
    with loop_hold(verifier, tmp_path):  # no pass runs until the hold is lifted
        stream = client.stream(build_request("def tree(x):", max_new_tokens=200), timeout=300)
        assert wait_until(lambda: app.num_active.remote().result() == 1, timeout_s=60)  # admitted, frozen
        ray.kill(ray.get_actor(rank1, namespace=rank_actors()[rank1]), no_restart=True)
    began = time.monotonic()
    with pytest.raises(grpc.RpcError) as failed:
        for _ in stream:
            pass
    print(f"killed rank: the stream failed {time.monotonic() - began:.1f} s after the forward was let go")
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
    target = AutoModelForCausalLM.from_pretrained(tiny_models["target"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["target"])
    reply = client.generate(build_request("speculative inference", max_new_tokens=21), timeout=300)
    assert list(reply.token_ids) == reference_greedy(target, tokenizer.encode("speculative inference"), 21)
    assert rank1 not in rank_actors()
    free, unreserved, total = ray.get(verifier.pool_blocks.remote())
    assert free == unreserved == total


@pytest.mark.gpu
def test_two_gpu_ranks_over_nccl_match_single_process(engines, tiny_args):
    """On a machine with 2+ GPUs: one GPU per rank, NCCL; the same greedy ids as tp=1 on CPU."""
    from cluster.build import build_engine, close_engine
    from settings.config import EngineConfig

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    gpu = {**TP_VERIFIER, "actor": {"num_cpus": 0.25, "num_gpus": 1, "torch_threads": 1}}
    engine = build_engine(EngineConfig.model_validate({**tp_args(tiny_args), "device": "cuda", "verifier": gpu}))
    try:
        request = GenerationRequest(tuple(range(40, 60)), 40, speculation=SpeculationOptions(expansion=(2, 2, 1)))
        assert engine.generate(request).token_ids == engines[0].generate(request).token_ids
    finally:
        close_engine(engine)



def test_grpc_prefetch_with_a_tensor_parallel_verifier_and_batching(serving, tp2_app, tiny_models):
    """SSM actors draft ahead (in their packed forwards) while the 2 ranks verify: fp32 greedy ids
    equal generate's, prefetch ran, and every pool block (the prepared trees' included) comes back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.serve_client import build_request
    from tests.test_serving import pools_settled

    client, app, _ = tp2_app
    target = AutoModelForCausalLM.from_pretrained(tiny_models["target"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["target"])
    ran = 0
    for prompt, n in [("def tree(x):", 30), ("speculative inference", 21)]:
        reply = client.generate(build_request(prompt, max_new_tokens=n, prefetch=2), timeout=300)
        assert list(reply.token_ids) == reference_greedy(target, tokenizer.encode(prompt), n)
        ran += reply.stats.prefetch_hits + reply.stats.prefetch_misses
    assert ran > 0
    assert wait_until(lambda: pools_settled(app), timeout_s=60)


def test_ranks_that_cannot_be_placed_fail_with_what_they_need(ray_session, tiny_args):
    """Two ranks of 64 CPUs each on a cluster that has a few: the group's start fails within
    server.actor_placement_timeout_s, naming the need and the cluster, and leaves no group behind."""
    from actors.placement import PlacementFailed
    from actors.rank_group import RankGroup
    from ray.util import placement_group_table
    from settings.config import EngineConfig

    args = tp_args(tiny_args)
    args = {**args, "verifier": {**args["verifier"], "actor": {"num_cpus": 64, "torch_threads": 1}},
            "server": {**args["server"], "actor_placement_timeout_s": 1.0}}
    before = {g for g, row in placement_group_table().items() if row["state"] != "REMOVED"}
    with pytest.raises(PlacementFailed) as failed:
        RankGroup(EngineConfig.model_validate(args), name_prefix="unplaceable")
    message = str(failed.value)
    assert message.startswith("the tensor-parallel verifier's 2 ranks could not be placed on one node (STRICT_PACK) "
                              "within 1 s (server.actor_placement_timeout_s): they need 128 CPU (rank-0 64, rank-1 64)")
    assert "no node has 64 CPU for the rank-0" in message
    after = {g for g, row in placement_group_table().items() if row["state"] != "REMOVED"}
    assert after <= before
