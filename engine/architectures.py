"""Which decoder-only families tree verification supports, how their layers take a sliding window,
and why the others are refused (no torch or transformers import: the merge actor and the ingress read it)."""

from __future__ import annotations

# The decoder-only families tree verification supports, each one a row of tests/test_architectures.py
# (tiny random model: greedy output equal to generate in-process, in the engine loop over the paged
# pool), and how its layers take a sliding window (``engine.masks``):
#   None           full attention on every layer
#   "every_layer"  config.sliding_window, when set, on every layer: one 4-D mask serves them all
#   "layer_types"  config.layer_types names each layer "full_attention" or "sliding_attention"
#                  (config.sliding_window): the model takes a dict of 4-D masks, one per kind
SUPPORTED_ARCHITECTURES: dict[str, str | None] = {
    "llama": None, "granite": None, "olmo2": None, "gemma": None,
    "mistral": "every_layer", "phi3": "every_layer", "starcoder2": "every_layer",
    "qwen2": "layer_types", "qwen3": "layer_types", "gemma2": "layer_types", "gemma3_text": "layer_types",
    "olmo3": "layer_types",
}
LAYER_KINDS = ("full_attention", "sliding_attention")

# Why the families that cannot take a tree mask over a gathered KV cache are refused (model_type -> reason).
REFUSED_ARCHITECTURES = {
    **dict.fromkeys(("mamba", "mamba2", "rwkv", "xlstm", "falcon_mamba", "recurrent_gemma", "jamba", "zamba",
                     "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "lfm2", "qwen3_next", "nemotron_h",
                     "minimax", "plamo2"),
                    "a recurrent (state-space or linear-attention) layer keeps a running state, not per-token "
                    "KV entries that a tree mask can select and a commit can gather"),
    **dict.fromkeys(("bloom", "mpt"), "ALiBi position biases are added inside attention from key indices, "
                                      "which a tree's positions (prefix + depth) do not follow"),
    "gemma3": "it is the multimodal model: serve its text model (model_type gemma3_text)",
    **dict.fromkeys(("llama4", "llama4_text"), "its chunked attention layers are neither full nor sliding-window "
                                               "attention"),
}
