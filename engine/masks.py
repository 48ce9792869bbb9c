"""The attention masks a Hugging Face forward over a DynamicCache takes for a tree or a draft level,
with each layer's sliding window applied (``engine.architectures.SUPPORTED_ARCHITECTURES`` says how a
family's layers take windows).

A 4-D mask is used as it is by every layer it reaches (``transformers.masking_utils`` returns a
4-D mask unchanged), so a window must already be in it: a family with a window on every layer
gets one windowed mask; a family whose ``config.layer_types`` mixes full and sliding layers gets a
dict ``{"full_attention": mask, "sliding_attention": windowed mask}``, which its model hands each
layer by kind. The paged pool applies the same windows inside its attention function
(``engine.packed``), from the window each layer passes it.
"""

from __future__ import annotations

import torch

from .architectures import SUPPORTED_ARCHITECTURES
from .tree import attention_bias


def sliding_window(config) -> int | None:
    """The window (in positions) the model's sliding layers use; None: every layer attends fully.

    Example: Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1) -> 8;
    LlamaConfig() -> None.
    """
    style = SUPPORTED_ARCHITECTURES.get(getattr(config, "model_type", None))
    window = getattr(config, "sliding_window", None)
    if style is None or window is None:
        return None
    if style == "layer_types" and "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
        return None
    return int(window)


def forward_masks(
    config,
    visible: torch.Tensor,  # [Q, K] bool over the speculative keys
    prefix_length: int,
    query_positions: torch.Tensor,  # [Q] int64
    key_positions: torch.Tensor,  # [K] int64
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | dict[str, torch.Tensor]:  # [1, 1, Q, prefix_length + K], or one per layer kind
    """The ``attention_mask`` argument for a forward of Q tokens after ``prefix_length`` cached ones
    and K - Q speculative ones (``engine.tree.attention_bias``), windowed where the model's layers are.

    Example: a gemma2 config (window 4096, layers sliding and full) and a 10-token tree after 5000
    cached tokens -> {"full_attention": the tree mask, "sliding_attention": the same mask with
    cached positions up to 904 + depth cut for a node at 5000 + depth}.
    """
    full = attention_bias(visible, prefix_length, dtype).to(device)
    window = sliding_window(config)
    if window is None or int(query_positions.max()) < window:  # the window reaches back to position 0
        cut = full
    else:
        cut = attention_bias(visible, prefix_length, dtype, window, query_positions, key_positions).to(device)
    if SUPPORTED_ARCHITECTURES.get(config.model_type) == "layer_types":
        return {"full_attention": full, "sliding_attention": cut}
    return cut
