"""CUDA-graph forwards over a fixed KV buffer (engine.graphs, engine.graphed_models).

On the CPU the runner runs every forward eagerly over the same buffer, mask and bookkeeping, so
these tests check that path: the device-built mask against ``attention_bias``, commits and saved
entries, a tree forward's logits against the DynamicCache target's, and fp32 greedy output equal
to the target's own for every mode (prefetch and cost-aware shapes included); one request holds a
buffer at a time. The ``gpu`` tests replay the captured graphs: logits equal to the eager path's
and greedy output equal to the target's own.
"""

from __future__ import annotations

import pytest
import torch

from engine.draft import ModelDrafter
from engine.generate import SpeculativeEngine
from engine.graphed_models import GraphedDrafter, GraphedTarget, chain
from engine.graphs import GraphRunner, device_bias
from engine.requests import GenerationRequest, SpeculationOptions
from engine.sampling import SamplingParams
from engine.shape import TreeCost
from engine.target import TargetModel
from engine.tree import TokenTree, attention_bias
from tiny_models import IdTokenizer, reference_greedy, tiny_model

BIASES = [  # (committed, visible, buffer slots)
    (2, [[1, 0], [1, 1]], 5),  # the docstring's example
    (0, [[1]], 3),  # a first token: it sees itself only
    (3, [[1, 0, 0], [1, 1, 0], [1, 0, 1]], 8),  # a small tree after three committed entries
    (4, [[0, 1]], 6),  # a level whose earlier sibling is hidden
]


@pytest.mark.parametrize("committed,visible,slots", BIASES)
def test_device_bias_is_attention_bias_over_the_whole_buffer(committed, visible, slots):
    visible = torch.tensor(visible, dtype=torch.bool)
    bias = device_bias(torch.tensor([committed]), visible, torch.arange(slots), torch.float32)
    used = committed + visible.shape[1]
    assert torch.equal(bias[..., :used], attention_bias(visible, committed, torch.float32))
    assert bool((bias[..., used:] == torch.finfo(torch.float32).min).all())  # nothing past the used slots


def test_one_request_holds_a_buffer_at_a_time():
    runner = GraphRunner(tiny_model("qwen2"), 64)
    first = runner.claim()
    with pytest.raises(RuntimeError, match="one request at a time"):
        runner.claim()
    runner.release(first)
    runner.release(first)  # idempotent
    runner.release(runner.claim())


def test_a_forward_past_the_buffer_is_refused():
    runner = GraphRunner(tiny_model("qwen2"), 8)
    with pytest.raises(ValueError, match="needs 9 KV slots; the buffer has 8"):
        runner.forward(torch.arange(9), torch.arange(9), 0, chain(9))


def test_tree_logits_and_commit_match_the_dynamic_cache_target():
    model = tiny_model("qwen2", layers=2)
    plain, graphed = TargetModel(model), GraphedTarget(GraphRunner(model, 64))
    prompt, tree = list(range(3, 13)), TokenTree(torch.tensor([5, 7, 9, 11, 13]), torch.tensor([-1, 0, 0, 1, 3]))
    states = plain.new_state(), graphed.new_state()
    for target, state in zip((plain, graphed), states):
        target.prefill(state, prompt)
    expected, got = plain.forward_tree(states[0], tree), graphed.forward_tree(states[1], tree)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for target, state in zip((plain, graphed), states):
        target.commit(state, len(prompt), (0, 1, 3))
    assert states[1].length == states[0].length == len(prompt) + 3
    after = TokenTree(torch.tensor([13, 2]), torch.tensor([-1, 0]))  # the next step sees the kept path only
    torch.testing.assert_close(graphed.forward_tree(states[1], after), plain.forward_tree(states[0], after),
                               rtol=1e-4, atol=1e-4)


def test_a_model_given_to_a_runner_still_runs_the_dynamic_cache_path():
    """Several new tokens after cached ones need the causal mask transformers builds (a bug once: the
    static attention had no mask builder, so that path silently lost its mask)."""
    from transformers import DynamicCache

    from engine import kv

    def after_cached(model):  # logits of 3 tokens fed after 5 cached ones
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.arange(5)[None], **kv.cache_argument(model, cache), use_cache=True)
        return model(input_ids=torch.tensor([[7, 8, 9]]), **kv.cache_argument(model, cache), use_cache=True).logits

    with torch.inference_mode():
        expected, model = after_cached(tiny_model("qwen2", seed=3)), tiny_model("qwen2", seed=3)
        GraphRunner(model, 16)
        torch.testing.assert_close(after_cached(model), expected)


def test_saved_entries_come_back_row_by_row():
    runner = GraphRunner(tiny_model("qwen2"), 32)
    runner.forward(torch.arange(6), torch.arange(6), 0, chain(6))
    saved = runner.save(2, 6)  # entries 2, 3, 4, 5
    runner.put(10, saved, rows=[3, 1])
    assert torch.equal(runner.keys[:, :, 10:12], runner.keys[:, :, [5, 3]])
    assert torch.equal(runner.values[:, :, 10:12], runner.values[:, :, [5, 3]])


MODES = [
    SpeculationOptions(mode="incremental"),
    SpeculationOptions(mode="sequence", sequence_depth=4),
    SpeculationOptions(mode="tree", expansion=(2, 2, 1, 1), min_confidence=0.0, adaptive=False),
    SpeculationOptions(mode="tree", expansion=(3, 1, 1), prefetch=2, adaptive=False),
    SpeculationOptions(mode="tree", policy="cost"),
]


def graphed_engine(target, ssm, capacity: int = 256, cost: TreeCost | None = None) -> SpeculativeEngine:
    return SpeculativeEngine(GraphedTarget(GraphRunner(target, capacity)),
                             [GraphedDrafter(GraphRunner(ssm, capacity), 0, "ssm")], IdTokenizer(), set(), cost=cost)


@pytest.mark.parametrize("ssm_layers,ssm_seed", [(1, 1), (2, 0)])  # a weak SSM; the target itself (long chains)
@pytest.mark.parametrize("options", MODES, ids=lambda o: f"{o.mode}-{o.policy}-prefetch{o.prefetch}")
def test_fp32_greedy_output_is_the_targets_own(options, ssm_layers, ssm_seed):
    target, ssm = tiny_model("qwen2", layers=2, seed=0), tiny_model("qwen2", layers=ssm_layers, seed=ssm_seed)
    engine = graphed_engine(target, ssm, cost=TreeCost(((1, 5.0), (64, 9.0))))
    for prompt in (list(range(5, 25)), [3, 1, 4, 1, 5, 9, 2, 6]):
        result = engine.generate(GenerationRequest(tuple(prompt), 30, speculation=options))
        assert list(result.token_ids) == reference_greedy(target, prompt, 30)
    assert engine.target.runner.holder is None and engine.drafters[0].runner.holder is None  # released


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_sampling_draws_as_the_dynamic_cache_engine_does(seed):
    """Same seed, same draws: the buffer changes where entries live, not what is drawn (fp32)."""
    target, ssm = tiny_model("qwen2", layers=2, seed=0), tiny_model("qwen2", layers=1, seed=1)
    plain = SpeculativeEngine(TargetModel(target), [ModelDrafter(ssm, 0, "ssm")], IdTokenizer(), set())
    options = SpeculationOptions(mode="tree", expansion=(2, 1, 1), children="sampled", adaptive=False)
    request = GenerationRequest((5, 6, 7, 8), 24, SamplingParams(temperature=1.0, seed=seed), speculation=options)
    assert graphed_engine(target, ssm).generate(request).token_ids == plain.generate(request).token_ids


@pytest.mark.gpu
def test_graph_replays_match_eager_forwards_and_greedy_is_exact():
    target = tiny_model("qwen2", layers=2, seed=0).cuda()
    ssm = tiny_model("qwen2", layers=1, seed=1).cuda()
    replayed, eager = GraphRunner(target, 128), GraphRunner(tiny_model("qwen2", layers=2, seed=0).cuda(), 128,
                                                            graphs=False)
    for runner in (replayed, eager):
        runner.forward(torch.arange(10), torch.arange(10), 0, chain(10))
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    args = (torch.tensor([4, 5, 6]), torch.tensor([10, 11, 11]), 10, visible)
    torch.testing.assert_close(replayed.forward(*args), eager.forward(*args), rtol=1e-4, atol=1e-4)
    engine = graphed_engine(target, ssm)
    prompt = list(range(5, 25))
    for options in MODES[:4]:
        result = engine.generate(GenerationRequest(tuple(prompt), 30, speculation=options))
        assert list(result.token_ids) == reference_greedy(target, prompt, 30)


@pytest.mark.parametrize("device,enabled,slots", [
    ("cpu", True, 0),  # graphs need CUDA
    ("cuda", False, 0),  # switched off
    ("cuda", True, 4096 + 3 * 64),  # a request's tokens, then a tree of max_tree_nodes per proposer (SSM, suffix) + levels
])
def test_the_in_process_engine_uses_graphs_on_cuda_only(monkeypatch, device, enabled, slots):
    pytest.importorskip("ray", reason="cluster.build needs the project's serving packages (a bare GPU image lacks them)")
    from cluster.build import graph_capacity
    from settings.config import EngineConfig

    config = EngineConfig.model_validate({"target": {"name": "t", "source": "t"}, "ssms": [{"name": "s", "source": "s"}],
                                          "cuda_graphs": enabled, "speculation": {"max_tree_nodes": 64}})
    model = tiny_model("qwen2")
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device(device)))
    assert graph_capacity(config, TargetModel(model)) == slots
