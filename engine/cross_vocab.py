"""Drafting through text: an SSM whose tokenizer differs from the target's (another model family).

Universal assisted generation (as in transformers' ``UniversalSpeculativeDecodingGenerator``): the
SSM reads the committed text in its own tokens, drafts a greedy chain in its own vocabulary, and
the chain's text is re-encoded with the target's tokenizer. Only the target tokens that follow the
committed ones exactly are proposed, and each is a deterministic draw (a point mass, q None, as the
suffix proposer's): ``engine.verify`` then accepts a token with the target's residual probability,
so sampled output stays the target's distribution, and such a draft merges beside the other
proposers' trees (``engine.merge``) unchanged.

The SSM draws no sampled children and takes no cost-aware shape: whatever the request's spec, it
drafts one greedy chain of the schedule's depth plus one token (the lookahead that tells which
re-encoded tokens are stable, ``stable_continuation``). It counts as neural all the same (``neural``):
it is a model, served on an SSM actor of its own, and it can carry a sequence-mode request.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from . import kv
from .draft import DraftSpec, Proposal, TreeBuilder

if TYPE_CHECKING:
    from transformers import DynamicCache

WINDOW = 4  # committed target tokens at most that a re-encoding may re-tokenize with the draft


@dataclass(frozen=True)
class TranslationCounts:
    """What drafting through text gave: SSM tokens drafted, target tokens proposed after
    re-encoding (the survivors), drafts, and drafts whose re-encoding proposed nothing."""

    drafted: int = 0
    survived: int = 0
    drafts: int = 0
    empty: int = 0

    def __add__(self, other: "TranslationCounts") -> "TranslationCounts":
        return TranslationCounts(self.drafted + other.drafted, self.survived + other.survived,
                                 self.drafts + other.drafts, self.empty + other.empty)


@dataclass
class CrossState:
    """One request on the cross-vocabulary drafter: its SSM cache and the SSM tokens it holds."""

    cache: DynamicCache
    ssm_ids: list[int] = field(default_factory=list)


def continuation(committed: Sequence[int], text: str, decode: Callable, encode: Callable,
                 window: int = WINDOW) -> list[int] | None:
    """Target tokens that follow ``committed`` when ``text`` is appended, or None when no re-encoding
    of the last 1..``window`` committed tokens' text with ``text`` starts with those very tokens.

    Example (characters as tokens, "ab" merged into one): committed [a], text "bc" -> encode("abc")
    is [ab, c], not after [a], and there is no longer tail: None; committed [x], text "ab" ->
    encode("xab") [x, ab] -> [ab].
    """
    for width in range(1, min(window, len(committed)) + 1):
        tail = list(committed[-width:])
        ids = encode(decode(tail) + text)
        if ids[:width] == tail:
            return ids[width:]
    return None


def stable_continuation(committed: Sequence[int], texts: Sequence[str], decode: Callable, encode: Callable,
                        window: int = WINDOW) -> list[int]:
    """The target tokens of the draft that its last drafted token does not change: the common
    prefix of the continuations of ``texts[-2]`` and ``texts[-1]`` (the draft's text without and with
    its last SSM token). A token at the draft's end may merge with what follows.

    Example (characters as tokens, "cd" merged): texts ["bc", "bcd"] -> [b, c] and [b, cd] -> [b].
    """
    shorter, longer = (continuation(committed, text, decode, encode, window) for text in texts[-2:])
    if shorter is None or longer is None:
        return []
    kept = 0
    while kept < min(len(shorter), len(longer)) and shorter[kept] == longer[kept]:
        kept += 1
    return longer[:kept]


def draft_texts(ssm_ids: Sequence[int], drafted: Sequence[int], decode: Callable, window: int = WINDOW) -> list[str]:
    """The text each prefix of ``drafted`` adds after ``ssm_ids`` (decoded with the last ``window``
    ids, so that a multi-byte character split across the boundary decodes whole).

    Example (characters as tokens): ssm_ids [a, b], drafted [c, d] -> ["", "c", "cd"].
    """
    base = list(ssm_ids[-window:])
    before = decode(base)
    texts = []
    for count in range(len(drafted) + 1):
        after = decode(base + list(drafted[:count]))
        texts.append(after[len(before):] if after.startswith(before) else "")
    return texts


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix. Example: [1, 2, 3], [1, 2, 4, 5] -> 2."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def fit_context(ssm_ids: list[int], depth: int, context: int | None) -> list[int]:
    """The last SSM tokens that leave room for ``depth`` drafted ones in the SSM's ``context``.

    Example: ids [1, 2, 3, 4, 5], depth 2, context 5 -> [3, 4, 5]; context None -> all of them.
    """
    if context is None or len(ssm_ids) + depth <= context:
        return ssm_ids
    return ssm_ids[len(ssm_ids) + depth - context:]


def chain_proposal(root: int, proposer: int, tokens: Sequence[int]) -> Proposal:
    """A chain root -> tokens[0] -> tokens[1] ..., every draw deterministic (a point mass).

    Example: root 5, tokens [9, 7] -> tree tokens [5, 9, 7], parents [-1, 0, 1].
    """
    builder = TreeBuilder(root=root, proposer=proposer)
    node = 0
    for token in tokens:
        node = builder.add(node, int(token), None)
    return builder.build()


class CrossVocabDrafter:
    """An SSM with a tokenizer of its own, drafting for the target through text (the drafter
    interface of ``engine.draft.ModelDrafter``'s ``draft``; its proposals are chains of point masses).

    Each draft re-encodes the committed text with the SSM's tokenizer (canonical SSM tokens whatever
    tokens the target chose), keeps the cache's common prefix with the last draft's SSM tokens, feeds
    the rest, drafts greedily, and proposes ``stable_continuation``'s target tokens. ``counts``: the
    drafter's totals over every request (a request's own are in its proposals' ``translated``, which
    its GenerationStats sum). Thread-safe per state.
    """

    neural = True  # a model: served on an SSM actor, and a sequence-mode request may use it

    def __init__(self, model, ssm_tokenizer, target_tokenizer, proposer: int, name: str, window: int = WINDOW):
        self.model, self.proposer, self.name, self.window = model, proposer, name, window
        self.ssm_tokenizer, self.target_tokenizer = ssm_tokenizer, target_tokenizer
        self.counts = TranslationCounts()
        self._lock = threading.Lock()

    def new_state(self) -> CrossState:
        return CrossState(kv.new_cache())

    def release(self, state: CrossState) -> None:
        """Nothing held outside the state (its DynamicCache is freed with it)."""

    def on_own_stream(self) -> contextlib.AbstractContextManager:
        """No stream of its own (``engine.prefetch`` calls it; this drafter never drafts ahead)."""
        return contextlib.nullcontext()

    @torch.inference_mode()
    def draft(self, state: CrossState, committed: list[int], spec: DraftSpec,
              generator: torch.Generator | None = None) -> Proposal:
        """A chain of at most ``spec.max_nodes - 1`` target tokens after ``committed`` (root last);
        ``generator`` is unused (the chain is greedy)."""
        text = self.target_tokenizer.decode(committed, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        depth = len(spec.schedule) + 1
        ssm_ids = fit_context(self.ssm_tokenizer.encode(text), depth,
                              getattr(self.model.config, "max_position_embeddings", None))
        drafted = self._greedy_chain(state, ssm_ids, depth)
        texts = draft_texts(ssm_ids, drafted, self._ssm_decode, self.window)
        tokens = stable_continuation(committed, texts, self._target_decode, self._target_encode, self.window)
        tokens = tokens[:(spec.max_nodes or len(tokens) + 1) - 1]
        with self._lock:
            self.counts += TranslationCounts(len(drafted), len(tokens), 1, int(not tokens))
        return replace(chain_proposal(committed[-1], self.proposer, tokens),
                       translated=((self.proposer, len(drafted), len(tokens)),))

    def _greedy_chain(self, state: CrossState, ssm_ids: list[int], depth: int) -> list[int]:
        """``depth`` greedy SSM tokens after ``ssm_ids``; the cache is left holding ``ssm_ids``."""
        if not ssm_ids:  # nothing to condition on (an empty committed text without a BOS)
            return []
        keep = min(common_length(state.ssm_ids, ssm_ids), kv.cache_length(state.cache), len(ssm_ids) - 1)
        kv.crop(state.cache, keep)
        feed, drafted = ssm_ids[keep:], []
        for _ in range(depth):
            ids = torch.tensor([feed], dtype=torch.long, device=self.model.device)  # [1, F]
            out = self.model(input_ids=ids, **kv.cache_argument(self.model, state.cache), use_cache=True,
                             logits_to_keep=1)
            feed = [int(out.logits[0, -1].argmax())]
            drafted.append(feed[0])
        kv.crop(state.cache, len(ssm_ids))
        state.ssm_ids = ssm_ids
        return drafted

    def _ssm_decode(self, ids: Sequence[int]) -> str:
        return self.ssm_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _target_decode(self, ids: Sequence[int]) -> str:
        return self.target_tokenizer.decode(ids, clean_up_tokenization_spaces=False)

    def _target_encode(self, text: str) -> list[int]:
        return self.target_tokenizer.encode(text, add_special_tokens=False)
