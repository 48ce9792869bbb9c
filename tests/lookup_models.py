"""Exact toy language models for distribution tests, and the chi-square helper they share.

A ``LookupLM`` is a second-order Markov "language model": its next-token logits are a fixed
random table indexed by the last two tokens, so p and q are known exactly and the exact
distribution of any output prefix can be enumerated. ``LookupDrafter`` is the real
``ModelDrafter`` drafting loop (choose_children, TreeBuilder, level by level) with the SSM
forward replaced by a table look-up. ``tiny_llama`` / ``tiny_tokenizer`` build a real random
Llama and a word-level tokenizer over its vocabulary for end-to-end and CLI tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from scipy.stats import chisquare

from engine.draft import ModelDrafter
from engine.sampling import SamplingParams, warp
from engine.tree import TokenTree, children
from engine.verify import Verdict


class LookupLM:
    """Next-token logits as a function of the last two tokens: ``table[prev, last]``."""

    def __init__(self, vocab: int, seed: int, scale: float = 2.5, base: "LookupLM | None" = None,
                 mix: float = 0.0, temperature: float = 1.0):
        """Random sharp logits (std ``scale``); with ``base``, ``mix`` of base's logits plus fresh
        noise, all divided by ``temperature`` (so a draft model can be correlated with the target
        yet markedly different)."""
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(vocab, vocab, vocab, generator=generator) * scale
        logits = noise if base is None else mix * base.table + (1.0 - mix) * noise
        self.table = logits / temperature  # [V, V, V]
        self.vocab = vocab

    def probs(self, params: SamplingParams) -> torch.Tensor:  # -> [V, V, V]
        """The warped next-token distribution for every (prev, last) context, in float64 (renormalised)."""
        probs = warp(self.table, params).double()
        return probs / probs.sum(dim=-1, keepdim=True)


def node_contexts(tree: TokenTree, committed: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:  # -> [N], [N]
    """(previous token, token) at every node: the context its next-token distribution sees."""
    tokens = tree.tokens
    prev = tokens[tree.parents.clamp(min=0)].clone()
    prev[0] = committed[-2]
    return prev, tokens


class NoCache:
    """A drafter state without KV entries (kv.crop over no layers is a no-op); hashed by identity,
    like the real states, since drafters key a request's shape history by its state."""

    layers = ()


class LookupDrafter(ModelDrafter):
    """ModelDrafter's own ``draft`` loop; the SSM forward is a table look-up (no KV cache).

    Its clock is simulated, so cost-aware shapes never depend on the machine's speed or load: it
    stands still except in a level forward over ``f`` nodes, which takes ``level_ms(f)`` (0 unless
    given). Example: ``level_ms=lambda f: 1.0 + f`` -> a one-node level moves the clock 2 ms.
    """

    keeps_levels = False  # no KV entries to keep

    def __init__(self, lm: LookupLM, proposer: int, name: str,
                 level_ms: Callable[[int], float] = lambda nodes: 0.0):
        super().__init__(model=None, proposer=proposer, name=name)
        self.lm, self.level_ms, self.now = lm, level_ms, 0.0

    def clock(self) -> float:  # seconds
        return self.now

    def new_state(self):
        return NoCache()

    def _extend(self, cache, committed: list[int]) -> tuple[torch.Tensor, int]:  # -> [V], tokens fed
        return self.lm.table[committed[-2], committed[-1]], 1

    def _forward_level(self, cache, builder, level, *_) -> torch.Tensor:  # -> [F, V]
        """Logits at each node of ``level`` (tree node indices), from its (parent, own) tokens."""
        self.now += self.level_ms(len(level)) / 1e3
        prev = [builder.tokens[builder.parents[n]] for n in level]
        last = [builder.tokens[n] for n in level]
        return self.lm.table[prev, last]


def prefix_distribution(probs: torch.Tensor, context: Sequence[int], length: int) -> np.ndarray:
    """Exact probability of every output prefix of ``length`` tokens (1 to 3) under ``probs``.

    probs: # [V, V, V] next-token distribution given (prev, last). Returns an array [V] * length.
    """
    a, b = context[-2], context[-1]
    joint = probs[a, b]  # [V]
    if length >= 2:
        joint = joint[:, None] * probs[b]  # [V, V]: p(x1) p(x2 | b, x1)
    if length >= 3:
        joint = joint[:, :, None] * probs  # [V, V, V]: ... p(x3 | x1, x2)
    return joint.numpy()


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    pvalue: float
    cells: int  # after pooling
    pooled: int  # cells folded into the pooled bin
    samples: int


def chi_square(samples: Sequence[Sequence[int]], expected_probs: np.ndarray) -> ChiSquare:
    """Pearson chi-square of sampled sequences against an exact distribution over sequences.

    Cells with expected count < 5 are pooled into one bin (grown from the smallest cells until
    it reaches 5). A sample in a cell of exact probability 0 gives p-value 0.
    """
    n = len(samples)
    observed = np.zeros(expected_probs.shape, dtype=np.int64)
    np.add.at(observed, tuple(np.asarray(samples).T), 1)
    expected_probs, observed = expected_probs.ravel(), observed.ravel()
    if observed[expected_probs <= 0].any():
        return ChiSquare(float("inf"), 0.0, 0, 0, n)
    expected = expected_probs / expected_probs.sum() * n
    order = np.argsort(expected)
    small = int(np.searchsorted(expected[order], 5.0))
    while small < len(order) and 0 < expected[order[:small]].sum() < 5.0:
        small += 1
    big = order[small:]
    obs = np.append(observed[big], observed[order[:small]].sum())
    exp = np.append(expected[big], expected[order[:small]].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(obs) < 2:
        raise ValueError("fewer than two cells after pooling: nothing to test")
    result = chisquare(obs, exp)
    return ChiSquare(float(result.statistic), float(result.pvalue), len(obs), small, n)


def tiny_llama(vocab: int, seed: int, layers: int = 1, hidden: int = 32, sharpness: float = 0.3):
    """A float32 random Llama in eval mode; lm_head std ``sharpness`` makes its logits sharp."""
    from tests.tiny_models import tiny_model

    model = tiny_model("llama", vocab, layers=layers, seed=seed, hidden=hidden)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, sharpness, generator=torch.Generator().manual_seed(seed))
    return model


def tiny_tokenizer(vocab: int):
    """A word-level fast tokenizer: token i is the word ``w{i}``; words split on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    backend = Tokenizer(models.WordLevel(words, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0")


def save_tiny_pair(models_dir, vocab: int, target_seed: int, ssm_seed: int) -> dict[str, str]:
    """``tiny_llama`` target (2 layers) and SSM (1 layer), each with ``tiny_tokenizer``, saved under
    ``models_dir`` as ``tiny-target`` and ``tiny-ssm``: the directories a config names. Returns the
    config's ``target`` and ``ssms`` entries."""
    tokenizer = tiny_tokenizer(vocab)
    for name, seed, layers in (("tiny-target", target_seed, 2), ("tiny-ssm", ssm_seed, 1)):
        tiny_llama(vocab, seed, layers).save_pretrained(models_dir / name)
        tokenizer.save_pretrained(models_dir / name)
    return {"target": {"name": "tiny-target", "source": "tiny-target"},
            "ssms": [{"name": "tiny-ssm", "source": "tiny-ssm"}]}


@torch.inference_mode()
def target_first_two(model, prompt: Sequence[int], sampling: SamplingParams) -> np.ndarray:  # -> [V, V]
    """Exact distribution of the first two tokens, from the target's own forwards."""
    vocab = model.config.vocab_size
    first = warp(model(torch.tensor([list(prompt)])).logits[0, -1], sampling)  # [V]
    batch = torch.tensor([list(prompt) + [token] for token in range(vocab)])  # [V, len + 1]
    second = warp(model(batch).logits[:, -1], sampling)  # [V, V]
    return (first[:, None].double() * second.double()).numpy()


def accept_first_draws(proposal, target_probs: torch.Tensor, generator) -> Verdict:  # target_probs [N, V]
    """NEGATIVE CONTROL, deliberately wrong: the first child of every node accepted whatever the target
    says, then a bonus token from p."""
    kids, node, path = children(proposal.tree.parents), 0, [0]
    while kids[node]:
        node = kids[node][0]
        path.append(node)
    return Verdict(tuple(path), int(torch.multinomial(target_probs[node].float(), 1, generator=generator)), True)
