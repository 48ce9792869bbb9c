"""Model loading checks: the architecture allow-list, one shared vocabulary, the CLI on a real model."""

from __future__ import annotations

import json

import pytest
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from cluster.cli import main
from engine.models import LoadedModel, ModelSpec, check_architecture, check_same_vocabulary
from tests.tiny_models import tiny_model


@pytest.mark.parametrize("config,message", [
    (MistralConfig(sliding_window=4096), "mistral"),
    (GPT2Config(), "gpt2"),
    (Qwen2Config(use_sliding_window=True, sliding_window=128, max_window_layers=1, num_hidden_layers=2), "sliding"),
])
def test_unsupported_architectures_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        check_architecture(config, "my-model")


@pytest.mark.parametrize("config", [LlamaConfig(), Qwen2Config()])
def test_supported_architectures_pass(config):
    check_architecture(config, "ok")


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def loaded(name, vocab_size, vocab):
    return LoadedModel(ModelSpec(name, f"/models/{name}"), tiny_model("llama", vocab_size, layers=1), FakeTokenizer(vocab))


@pytest.mark.parametrize("other_size,other_vocab", [(97, {"a": 0, "b": 2}), (98, {"a": 0, "b": 1})])
def test_vocabulary_mismatch_names_both_models(other_size, other_vocab):
    target = loaded("big-target", 97, {"a": 0, "b": 1})
    with pytest.raises(ValueError, match="small-ssm.*big-target"):
        check_same_vocabulary(target, loaded("small-ssm", other_size, other_vocab))
    check_same_vocabulary(target, loaded("twin", 97, {"a": 0, "b": 1}))


def test_cli_generate_json_matches_incremental(smollm2_dir, capsys):
    outputs = {}
    for mode in ("incremental", "tree", "sequence"):
        code = main(["generate", "--config", "configs/smollm2-fp32.yaml", "--prompt", "def add(a, b):",
                     "--max-new-tokens", "16", "--mode", mode, "--json"])
        assert code == 0
        outputs[mode] = json.loads(capsys.readouterr().out)
    for mode, out in outputs.items():
        assert out["token_ids"] == outputs["incremental"]["token_ids"], mode
        assert out["mode"] == mode and out["new_tokens"] == len(out["token_ids"])
        assert {"text", "target_steps", "tokens_per_step", "ms_per_token"} <= set(out)
    assert outputs["incremental"]["tokens_per_step"] == 1.0
    assert outputs["tree"]["target_steps"] <= outputs["incremental"]["target_steps"]


def test_cli_reports_config_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: {name: t, source: t}\nspeculation: {expansion: [0]}\n")
    assert main(["generate", "--config", str(bad), "--prompt", "x"]) == 2
    assert "expansion" in capsys.readouterr().err


@pytest.mark.parametrize("tied", [False, True])
def test_int8_keeps_bf16_embeddings_and_the_same_logits(tied):
    """quantize_int8 of a bf16 model keeps its input embeddings in bf16 (widened per lookup, which
    is exact), so its logits equal those of the same int8 model with a float32 table."""
    import copy

    import torch

    from engine.models import quantize_int8
    from tests.tiny_models import tiny_model

    model = tiny_model("llama", 97, layers=2, seed=3)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(torch.bfloat16)
    reference = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model).float(), {torch.nn.Linear},
                                                       dtype=torch.qint8)
    quantized = quantize_int8(model)
    assert quantized.get_input_embeddings().weight.dtype == torch.bfloat16
    ids = torch.tensor([[5, 17, 3, 88, 41]])
    with torch.inference_mode():
        assert torch.equal(quantized(ids).logits, reference(ids).logits)
