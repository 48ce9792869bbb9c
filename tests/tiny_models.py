"""Tiny random-initialised causal LMs built from a config, for fast exactness tests."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_model(arch: str = "llama", vocab_size: int = 97, layers: int = 2, seed: int = 0, hidden: int = 64):
    """A float32 model in eval mode; the seed decides the weights."""
    config_class, model_class = ARCHITECTURES[arch]
    config = config_class(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # Random weights give flat logits; sharpen them so greedy paths are stable and SSMs agree sometimes.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """The target's own greedy decoding with a plain generation config (no penalties)."""
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                              pad_token_id=eos if eos is not None else 0)
    ids = torch.tensor([prompt])
    # An explicit mask: generate would otherwise take every prompt token equal to pad_token_id as padding.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def greedy_to_eos(model, prompt: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """What an engine must answer, greedy: the model's own decoding up to and with its first EOS
    (an engine stops there: finish_reason "stop"), else all ``max_new_tokens``; never empty."""
    ids = reference_greedy(model, prompt, max_new_tokens)
    ends = [i for i, token in enumerate(ids) if token in eos_ids]
    ids = ids[: ends[0] + 1] if ends else ids
    assert ids, "no reference tokens"
    return ids


class IdTokenizer:
    """Decodes ids as space-separated numbers: enough for engines that only need text for stop strings."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(str(i) for i in ids)
