"""Greedy exactness on tiny random models: every mode equals the target's own generate()."""

from __future__ import annotations

import pytest

from actors.suffix import SuffixDrafter
from engine.draft import ModelDrafter
from engine.requests import GenerationRequest, SpeculationOptions
from engine.generate import SpeculativeEngine
from engine.models import onednn_linears
from engine.target import TargetModel
from settings.config import SuffixConfig
from tests.tiny_models import IdTokenizer, reference_greedy, tiny_model

PROMPTS = {
    "short": [3, 17, 5],
    "repetitive": [5, 9, 3, 5, 9, 11, 7, 5, 9, 3],
    "long": [(7 * i + 3) % 61 + 1 for i in range(90)],
}

CASES = [
    # arch, vocab, prompt, mode, expansion, proposers
    ("llama", 97, "short", "incremental", (1,), ("ssm",)),
    ("llama", 97, "repetitive", "sequence", (1,), ("ssm",)),
    ("llama", 97, "long", "tree", (3, 2, 1, 1), ("ssm",)),
    ("llama", 97, "repetitive", "tree", (2, 2, 2), ("ssm", "suffix")),
    ("llama", 300, "long", "tree", (4, 1, 1), ("ssm", "suffix")),
    ("qwen2", 64, "short", "tree", (2, 1, 1, 1, 1), ("ssm",)),
    ("qwen2", 64, "repetitive", "sequence", (1,), ("ssm",)),
    ("qwen2", 151, "long", "tree", (3, 3), ("ssm", "suffix")),
    ("qwen2", 151, "repetitive", "tree", (1,), ("suffix",)),
]


def make_engine(target, ssm, eos=None) -> SpeculativeEngine:
    drafters = [ModelDrafter(ssm, 0, "ssm"), SuffixDrafter(1, SuffixConfig(max_spec_tokens=5))]
    return SpeculativeEngine(TargetModel(target), drafters, IdTokenizer(), eos_ids=set() if eos is None else {eos})


@pytest.mark.parametrize("linears", ["torch", "onednn", "onednn_packed"])
@pytest.mark.parametrize("arch,vocab,prompt,mode,expansion,proposers", CASES)
def test_greedy_matches_generate(arch, vocab, prompt, mode, expansion, proposers, linears):
    target = tiny_model(arch, vocab, layers=2, seed=1)
    ssm = tiny_model(arch, vocab, layers=1, seed=2)
    if linears != "torch":  # the config's cpu_linears: the reference runs on the same kernels
        packed = linears == "onednn_packed"
        assert onednn_linears(target, 0, packed) == 15 and onednn_linears(ssm, 0, packed) == 8
    engine = make_engine(target, ssm)
    options = SpeculationOptions(mode=mode, expansion=expansion, sequence_depth=3, proposers=proposers)
    result = engine.generate(GenerationRequest(tuple(PROMPTS[prompt]), 40, speculation=options))
    assert list(result.token_ids) == reference_greedy(target, PROMPTS[prompt], 40)
    assert result.finish_reason == "length"
    assert result.stats.new_tokens == 40


@pytest.mark.parametrize("mode,expansion", [("tree", (2, 2, 1, 1)), ("sequence", (1,)), ("incremental", (1,))])
def test_self_drafting_accepts_everything(mode, expansion):
    """With the target as its own SSM every drafted chain is accepted: tokens/step = depth + 1."""
    target = tiny_model("llama", 97, layers=2, seed=1)
    engine = SpeculativeEngine(TargetModel(target), [ModelDrafter(target, 0, "self")], IdTokenizer(), set())
    options = SpeculationOptions(mode=mode, expansion=expansion, sequence_depth=4)
    result = engine.generate(GenerationRequest((3, 17, 5), 41, speculation=options))
    assert list(result.token_ids) == reference_greedy(target, [3, 17, 5], 41)
    steps = result.stats.target_steps - 1
    expected_per_step = 1 if mode == "incremental" else 5
    assert result.stats.new_tokens == 1 + steps * expected_per_step
    if mode != "incremental":
        assert result.stats.accepted_per_depth == [steps] * 4
        assert result.stats.accepted_per_proposer == {"self": 4 * steps}


@pytest.mark.parametrize("eos_index", [3, 7, 12])
def test_eos_inside_tree(eos_index):
    """EOS drafted mid-tree: output stops right after EOS exactly as generate() does."""
    target = tiny_model("llama", 97, layers=2, seed=1)
    prompt = PROMPTS["short"]
    free_run = reference_greedy(target, prompt, 30)
    eos = free_run[eos_index]
    expected = reference_greedy(target, prompt, 30, eos=eos)
    engine = SpeculativeEngine(TargetModel(target), [ModelDrafter(target, 0, "self")], IdTokenizer(), {eos})
    result = engine.generate(GenerationRequest(tuple(prompt), 30, speculation=SpeculationOptions(expansion=(2, 2, 2, 2))))
    assert list(result.token_ids) == expected
    assert result.token_ids[-1] == eos and result.finish_reason == "stop"


def test_stop_string_cuts_text():
    target = tiny_model("llama", 97, layers=2, seed=1)
    free = make_engine(target, target).generate(GenerationRequest((3, 17, 5), 20))
    words = free.text.split(" ")
    stop = " ".join(words[4:6])
    result = make_engine(target, target).generate(GenerationRequest((3, 17, 5), 20, stop=(stop,)))
    assert result.finish_reason == "stop"
    assert result.text == free.text[: free.text.index(stop)]


def test_max_new_tokens_cuts_accepted_chain():
    target = tiny_model("llama", 97, layers=2, seed=1)
    engine = SpeculativeEngine(TargetModel(target), [ModelDrafter(target, 0, "self")], IdTokenizer(), set())
    for limit in (1, 2, 6):
        result = engine.generate(GenerationRequest((3, 17, 5), limit, speculation=SpeculationOptions(expansion=(1,) * 8)))
        assert list(result.token_ids) == reference_greedy(target, [3, 17, 5], limit)
        assert result.finish_reason == "length"


@pytest.mark.parametrize("adaptive", [True, False])
def test_the_suffix_proposer_s_global_store_keeps_greedy_output(adaptive):
    """A repeated request: adaptive, the suffix proposer proposes the first answer from the global
    store (fewer target steps); not adaptive, the second run is the first one again. Output is the
    target's own greedy output either way."""
    target = tiny_model("llama", 97, layers=2, seed=1)
    engine = SpeculativeEngine(TargetModel(target), [SuffixDrafter(0)], IdTokenizer(), set())
    options = SpeculationOptions(expansion=(1,), proposers=("suffix",), adaptive=adaptive)
    first, second = (engine.generate(GenerationRequest((3, 17, 5), 40, speculation=options)) for _ in range(2))
    assert list(first.token_ids) == list(second.token_ids) == reference_greedy(target, [3, 17, 5], 40)
    if adaptive:
        assert second.stats.target_steps < first.stats.target_steps / 2
        assert second.stats.accepted_per_proposer["suffix"] == second.stats.accepted_tokens > 20
    else:
        assert (second.stats.target_steps, second.stats.draft_tokens) == (first.stats.target_steps,
                                                                          first.stats.draft_tokens)
