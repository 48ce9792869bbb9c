"""Sampling settings and the warp that turns logits into the distribution p (or q)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch


MIN_TEMPERATURE, MIN_TOP_P = 1e-3, 1e-6  # below these the warp's float32 softmax turns to NaN


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. temperature 0 means greedy; top_k 0 and top_p 1 disable."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and (self.temperature == 0.0 or self.temperature >= MIN_TEMPERATURE)):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                             f"got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (math.isfinite(self.top_p) and MIN_TOP_P <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in [{MIN_TOP_P}, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [..., V] -> [..., V]
    """Probabilities after temperature, top-k and top-p (in that order), in float32.

    Example: logits [2, 1, 0], temperature 1, top_k 2 -> softmax([2, 1]) on the first two
    tokens, 0 on the third.
    """
    if params.greedy:
        raise ValueError("warp needs temperature > 0; greedy decoding takes the argmax")
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:  # [..., V] -> [..., V]
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def make_generator(seed: int | None, stream: int, position: int = 0) -> torch.Generator:
    """A CPU generator for one consumer of a request's randomness at one point of the request.

    stream 0 is the verifier, stream i + 1 the i-th proposer; ``position`` is the committed length
    a draft is made at, so a proposer's draws for a step never depend on how many drafts ran
    before (a prefetched draft and the normal one draw the same numbers). The three are hashed
    together (BLAKE2b), so neighbouring seeds, streams and positions give unrelated streams.
    Without a seed the generator is seeded from the OS.
    """
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(stream_seed(int(seed), stream, position))
    return generator


def stream_seed(seed: int, stream: int, position: int) -> int:
    """A 63-bit seed from (seed, stream, position): the first 8 bytes of their BLAKE2b digest.

    Unlike ``seed * 1_000_003 + stream``, (1, 1_000_003) and (2, 0) do not collide.
    """
    digest = hashlib.blake2b(f"{seed}/{stream}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
