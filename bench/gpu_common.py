"""What the GPU scripts (``gpu_verify_curve.py``, ``gpu_offload.py``, ``gpu_prefetch.py``) share:
they run on random-weight models without a tokenizer, timed between device synchronisations."""

from __future__ import annotations

import torch


class IdTokenizer:
    """Decodes ids as space-separated numbers (the engine only needs text for stop strings)."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def synchronize(device: str) -> None:
    """Wait for the device's queued work (CUDA), so a wall-clock interval covers it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
