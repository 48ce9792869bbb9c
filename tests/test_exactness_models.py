"""Greedy exactness on real models (float32): SmolLM2-135M and the default Qwen pair."""

from __future__ import annotations

import pytest

from cluster.build import build_engine
from settings.config import EngineConfig
from engine.models import OneDNNLinear, PackedOneDNNLinear
from engine.requests import GenerationRequest, SpeculationOptions
from engine.shape import TreeCost
from tests.tiny_models import greedy_to_eos

SMOL_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def smol_engine(models_dir, ssm_layers: int | None):
    config = EngineConfig.model_validate({
        "models_dir": str(models_dir), "dtype": "float32", "torch_threads": 2,
        "target": {"name": "smollm2", "source": "smollm2-135m-instruct"},
        "ssms": [{"name": "ssm", "source": "smollm2-135m-instruct", "num_layers": ssm_layers}],
        "suffix": {"name": "suffix"},
    })
    return build_engine(config)


@pytest.fixture(scope="module")
def smol_self(smollm2_dir):
    return smol_engine(smollm2_dir.parent, None)


@pytest.fixture(scope="module")
def smol_truncated(smollm2_dir):
    return smol_engine(smollm2_dir.parent, 8)


@pytest.fixture(scope="module")
def smol_expected(smol_self):
    """The target's own greedy continuation of SMOL_PROMPT (48 tokens or to EOS): computed once, as
    every test here asks the same target (both engines load the same full SmolLM2) the same prompt."""
    prompt = smol_self.tokenizer.encode(SMOL_PROMPT)
    return greedy_to_eos(smol_self.target.model, prompt, 48, smol_self.eos_ids)


@pytest.mark.parametrize("mode,expansion,proposers", [
    ("incremental", (1,), None), ("sequence", (1,), None), ("tree", (2, 2, 1), ("ssm",)), ("tree", (3, 1, 1), None),
])
def test_smollm2_with_itself_accepts_all(smol_self, smol_expected, mode, expansion, proposers):
    engine = smol_self
    prompt = engine.tokenizer.encode(SMOL_PROMPT)
    options = SpeculationOptions(mode=mode, expansion=expansion, sequence_depth=4, proposers=proposers,
                                 policy="schedule")
    result = engine.generate(GenerationRequest(tuple(prompt), 48, speculation=options))
    expected = smol_expected
    assert list(result.token_ids) == expected
    assert result.finish_reason == ("length" if len(expected) == 48 else "stop")
    if mode != "incremental":
        depth = 4 if mode == "sequence" else len(expansion)
        assert result.stats.accepted_per_depth[depth - 1] >= result.stats.target_steps - 3
        assert result.stats.accepted_per_proposer.get("ssm", 0) >= (result.stats.target_steps - 3) * depth


def test_smollm2_cost_aware_with_itself(smol_self, smol_expected):
    """The engine built from a config measured its verify-cost curve; cost-aware shapes with the
    target as its own SSM: the target's greedy output, and deep trees where passes cost the same."""
    engine = smol_self
    assert engine.cost is not None
    measured = engine.cost
    sizes = [size for size, _ in measured.verify_ms]
    assert len(sizes) > 1 and sizes == sorted(set(sizes)) and all(ms > 0 for _, ms in measured.verify_ms)
    # The sizes follow the measured curve and timings; a flat, slow pass makes deep trees certain.
    engine.cost = TreeCost(((1, 1e6), (64, 1e6)), measured.beam, measured.branch, measured.max_depth)
    prompt = engine.tokenizer.encode(SMOL_PROMPT)
    options = SpeculationOptions(proposers=("ssm",))
    try:
        result = engine.generate(GenerationRequest(tuple(prompt), 48, speculation=options))
    finally:
        engine.cost = measured
    assert list(result.token_ids) == smol_expected
    assert result.stats.tokens_per_step > 2.0 and max(result.stats.tree_sizes) > 2


@pytest.mark.parametrize("mode,expansion", [("sequence", (1,)), ("tree", (2, 2, 1))])
def test_smollm2_with_truncated_copy_rejects_most(smol_truncated, smol_expected, mode, expansion):
    engine = smol_truncated
    prompt = engine.tokenizer.encode(SMOL_PROMPT)
    options = SpeculationOptions(mode=mode, expansion=expansion, sequence_depth=4, proposers=("ssm",),
                                 policy="schedule")
    result = engine.generate(GenerationRequest(tuple(prompt), 48, speculation=options))
    assert list(result.token_ids) == smol_expected
    assert result.stats.accepted_per_proposer.get("ssm", 0) < result.stats.draft_tokens / 4


@pytest.mark.slow
@pytest.mark.parametrize("cpu_linears", ["onednn_packed"])
def test_default_qwen_pair_fp32(qwen_models_dir, cpu_linears):
    """The target's layers are above the oneDNN bound: its greedy decoding with packed weights (the
    shipped setting). Plain oneDNN weights: the same exactness on every tiny model and mode
    (tests/test_exactness_tiny.py, the bound lowered to 0), and the switch at the bound on real
    layer sizes (tests/test_models.py: test_onednn_linears_switches_...)."""
    config = EngineConfig.model_validate({
        "models_dir": str(qwen_models_dir), "dtype": "float32", "torch_threads": 2, "cpu_linears": cpu_linears,
        "target": {"name": "qwen1.5b", "source": "qwen2.5-coder-1.5b-instruct"},
        "ssms": [{"name": "qwen0.5b", "source": "qwen2.5-coder-0.5b-instruct"}],
        "suffix": {"name": "suffix"},
        # the schedule, not the cost policy: no verify-cost curve measured at build (seconds on the
        # 1.5B target in fp32); cost-aware shapes on a real model: test_smollm2_cost_aware_with_itself
        "speculation": {"policy": "schedule"},
    })
    engine = build_engine(config)
    kinds = {type(m) for m in engine.target.model.modules()}
    switched = PackedOneDNNLinear if cpu_linears == "onednn_packed" else OneDNNLinear
    assert switched in kinds and ({OneDNNLinear, PackedOneDNNLinear} - {switched}).isdisjoint(kinds)  # untied lm_head
    prompt = engine.tokenizer.encode("def quicksort(arr):\n    " + "# sort the list in place, recursively\n    " * 3)
    assert len(prompt) >= 32
    prompt = prompt[:32]
    result = engine.generate(GenerationRequest(tuple(prompt), 32, speculation=SpeculationOptions(expansion=(2, 2, 1, 1))))
    assert list(result.token_ids) == greedy_to_eos(engine.target.model, prompt, 32, engine.eos_ids)
    assert result.stats.tokens_per_step > 1.5


def test_smollm2_served_loop_with_a_windowed_ssm_stays_exact(smollm2_dir, smol_expected):
    """``ssms[].context_tokens`` from the config reaches the loop's drafter: the SSM (SmolLM2 itself)
    reads 16 tokens of the prompt at its first draft, drafts still get accepted, and the output is the
    target's own greedy continuation."""
    config = EngineConfig.model_validate({
        "models_dir": str(smollm2_dir.parent), "dtype": "float32", "torch_threads": 2,
        "target": {"name": "smollm2", "source": "smollm2-135m-instruct"},
        "ssms": [{"name": "ssm", "source": "smollm2-135m-instruct", "context_tokens": 16}],
        "suffix": None, "speculation": {"policy": "schedule"},
    })
    engine = build_engine(config, batched=True)
    assert engine.drafters[0].context_tokens == 16
    prompt = engine.tokenizer.encode(SMOL_PROMPT)
    assert len(prompt) > 16
    result = engine.generate(GenerationRequest(tuple(prompt), 48, speculation=SpeculationOptions(expansion=(2, 2, 1))))
    assert list(result.token_ids) == smol_expected
    assert result.stats.tokens_per_step > 1.5


@pytest.mark.parametrize("change, message", [
    ({"target": {"name": "t", "source": "x", "context_tokens": 64}}, "target.context_tokens"),
    ({"ssms": [{"name": "s", "source": "x", "context_tokens": 64, "cross_vocabulary": True}]}, "cross-vocabulary"),
    ({"ssms": [{"name": "s", "source": "x", "context_tokens": 0}]}, "greater than or equal to 1"),
])
def test_context_tokens_is_checked(change, message):
    args = {"target": {"name": "t", "source": "x"}, "ssms": [{"name": "s", "source": "x"}], **change}
    with pytest.raises(ValueError, match=message):
        EngineConfig.model_validate(args)
