"""Tiny random-initialised causal LMs built from a config, for fast exactness tests."""

from __future__ import annotations

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}

# Every family on engine.models' allow-list: (config class, model class, config settings beyond the
# common tiny ones). Windows are set by ``family_model``; the settings make each family's own parts
# count: gemma2's logit softcaps, gemma's query scaling, granite's multipliers, phi3's fused qkv.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=4.0, logits_scaling=0.5,
                                                            residual_multiplier=0.5, attention_multiplier=0.1)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, query_pre_attn_scalar=24,
                                                         attn_logit_softcapping=1.0, final_logit_softcapping=8.0)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, query_pre_attn_scalar=24)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {}),
}


def family_model(family: str, vocab_size: int = 97, layers: int = 2, seed: int = 0, window: int | None = None,
                 hidden: int = 64, kv_heads: int = 2):
    """A float32 tiny model of ``family`` in eval mode (4 query heads, ``kv_heads`` key/value heads).
    ``window``: the sliding window of its sliding layers (None: every layer full attention). Where a
    family mixes layer kinds, one layer is full and the others sliding (one layer: sliding)."""
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra, **_window_settings(family, layers, window),
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # sharper logits: stable greedy paths, SSMs that agree sometimes
        model.lm_head.weight.mul_(8.0)
        for name, parameter in model.named_parameters():  # peaked attention: scores large enough to softcap
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(4.0)
    return model


def _window_settings(family: str, layers: int, window: int | None) -> dict:
    """Config settings that give ``family`` the sliding ``window`` (none: full attention)."""
    kinds = ["sliding_attention"] * max(1, layers - 1) + ["full_attention"] * (layers > 1)
    if family in ("qwen2", "qwen3"):  # layers from max_window_layers on are sliding
        return dict(use_sliding_window=window is not None, sliding_window=window, max_window_layers=layers - 1)
    if family in ("gemma2", "gemma3_text", "olmo3"):
        return dict(sliding_window=window or 4096, layer_types=kinds if window else ["full_attention"] * layers)
    if family in ("mistral", "phi3", "starcoder2"):
        return dict(sliding_window=window)
    return {}


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
