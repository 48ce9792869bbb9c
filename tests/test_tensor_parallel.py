"""Tensor-parallel verification (DeepSpeed AutoTP, 2 rank actors over gloo on CPU) against tp=1.

fp32 throughout: tp=2 all-reduces partial sums, so its logits differ from tp=1 by float rounding
only (about 1e-6 here); greedy token ids must be identical, in-process and through gRPC.
"""

from __future__ import annotations

import glob
import time

import pytest
import torch

from engine.requests import GenerationRequest, SpeculationOptions
from engine.tree import TokenTree
from serving_fixtures import (  # noqa: F401  (fixtures)
    _SESSION, engine_args, ray_session, serving, tiny_args, tiny_models)
from tests.tiny_models import reference_greedy

pytestmark = pytest.mark.ray

pytest.importorskip("deepspeed")

TP_VERIFIER = {"tensor_parallel_size": 2, "collective_timeout_s": 20.0, "actor": {"num_cpus": 0.25, "torch_threads": 2}}


def tp_args(args: dict) -> dict:
    server = {**args.get("server", {}), "batching": {"enabled": False}}
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
    ([7, 7, 7, 9, 7, 7, 7], 25, SpeculationOptions(expansion=(3, 1, 1, 1), proposers=("ngram",))),
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
    counts = ray.get([rank.num_states.remote() for rank in parallel.target.ranks])
    assert counts == [0, 0]


def test_failed_rank_fails_fast_and_group_is_rebuilt(ray_session, tiny_args):
    """Kill rank 1: the next call fails within seconds (not the collective timeout), the old
    request's state is gone, and a new request runs on a rebuilt group with the same output."""
    import ray

    from actors.common import StateLost
    from actors.tensor_parallel import RanksFailed
    from cluster.build import build_engine
    from settings.config import EngineConfig

    engine = build_engine(EngineConfig.model_validate(tp_args(tiny_args)))
    try:
        target, prompt = engine.target, list(range(50, 70))
        address = ray.get(target.ranks[0].group_address.remote())
        before = engine.generate(GenerationRequest(tuple(prompt), 12)).token_ids
        state = target.new_state()
        target.prefill(state, prompt)
        ray.kill(target.ranks[1], no_restart=True)
        began = time.monotonic()
        with pytest.raises(RanksFailed):
            target.forward_tree(state, TokenTree.root_only(3))
        assert time.monotonic() - began < 10
        assert not glob.glob(f"/dev/shm/deepspeed_*_{address[0]}_{address[1]}_*")
        with pytest.raises(StateLost):
            target.forward_tree(state, TokenTree.root_only(3))
        assert engine.generate(GenerationRequest(tuple(prompt), 12)).token_ids == before
        assert target.generation == 2
    finally:
        engine.target.shutdown()


def test_grpc_generation_with_tensor_parallel_verifier(serving, tiny_args, tiny_models):
    """A second Serve application whose verifier is 2 ranks: the same ids as tp=1 and generate."""
    from ray import serve
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.serve_app import app_builder
    from cluster.serve_client import Client, build_request

    name = "specinfer-tp2"
    serve.run(app_builder(tp_args(tiny_args)), name=name, route_prefix="/tp2", blocking=False)
    try:
        with Client(serving, application=name) as client, Client(serving) as single:
            client.wait_ready(300)
            target = AutoModelForCausalLM.from_pretrained(tiny_models["target"]).eval()
            tokenizer = AutoTokenizer.from_pretrained(tiny_models["target"])
            for prompt, max_new_tokens in [("def tree(x):", 30), ("speculative inference", 21)]:
                request = build_request(prompt, max_new_tokens=max_new_tokens)
                reply = list(client.generate(request, timeout=120).token_ids)
                assert reply == list(single.generate(request, timeout=120).token_ids)
                assert reply == reference_greedy(target, tokenizer.encode(prompt), max_new_tokens)
    finally:
        serve.delete(name)


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
