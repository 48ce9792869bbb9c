"""The target and the SSM drafters over a paged KV pool, with forwards batched across requests.

``PagedTarget`` has ``TargetModel``'s methods and ``PagedDrafter`` is a ``ModelDrafter``: the
speculative step (draft -> merge -> verify -> commit) is the same code; only their forwards go
through a ``ForwardBatcher``, which packs the forwards of every request thread into one and runs
it on a ``PackedModel``: ``engine.packed.PagedModel`` in this process, or
``actors.tensor_parallel.TensorParallelPagedModel`` over tensor-parallel ranks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .batcher import BatchWaits, ForwardBatcher
from .draft import DraftSpec, ModelDrafter, Proposal, TreeBuilder, level_visibility
from .kv_pool import BlockPool, PagedSequence, SavedEntries
from .packed import ForwardItem, PackedModel, PagedModel, PromptChunk, chain_item
from .programs import Forward, Program, drive
from .timing import median_ms
from .tree import TokenTree, ancestor_mask, positions


class PagedTarget:
    """The target (``engine.target.Target``): each request is a PagedSequence (its block table in
    the pool)."""

    def __init__(self, model, pool: BlockPool, batcher: ForwardBatcher):
        self.model, self.pool, self.batcher = model, pool, batcher
        self.packed = batcher.model  # what runs a batch of items (engine.loop hands it every request's)

    def new_state(self, reserve_tokens: int = 0) -> PagedSequence:
        return PagedSequence(self.pool, reserve_tokens)

    def prefill(self, state: PagedSequence, prompt_ids: list[int]) -> torch.Tensor:  # -> [V]
        return feed(self.batcher, state, list(prompt_ids), prompt=True)

    def forward_tree(self, state: PagedSequence, tree: TokenTree) -> torch.Tensor:  # -> [N, V]
        return self.batcher.submit(tree_item(state, tree))

    def prefill_program(self, state: PagedSequence, prompt_ids: list[int], chunk_tokens: int | None = None) -> Program:
        """``prefill`` as a program (``engine.programs``): one packed forward per chunk of at most
        ``chunk_tokens`` prompt tokens (None: the whole prompt in one). Returns the logits [V]."""
        return feed_program(self.packed, state, list(prompt_ids), chunk_tokens)

    def tree_program(self, state: PagedSequence, tree: TokenTree) -> Program:  # -> [N, V]
        """``forward_tree`` as a program: the tree as one item of a packed target pass."""
        return (yield Forward(self.packed, tree_item(state, tree)))

    def commit(self, state: PagedSequence, prefix_length: int, path: tuple[int, ...]) -> None:
        assert prefix_length == state.length, "commit must follow forward_tree on the same state"
        state.keep(list(path))

    def release(self, state: PagedSequence) -> None:
        state.release()

    def shutdown(self) -> None:
        """Stop what runs the forwards outside this process (tensor-parallel ranks), if anything."""
        self.batcher.model.shutdown()


class PagedDrafter(ModelDrafter):
    """A neural SSM drafting over its own pool; one forward per tree level for all requests."""

    own_stream = False  # a packed forward runs on whichever request's thread leads it: one stream for all
    keeps_levels = False  # not yet: each draft feeds every token the last step accepted

    def __init__(self, model, proposer: int, name: str, pool: BlockPool, batcher: ForwardBatcher):
        super().__init__(model, proposer, name)
        self.pool, self.batcher = pool, batcher
        self.packed = batcher.model  # what runs a batch of items (engine.loop hands it every request's)

    def new_state(self, reserve_tokens: int = 0) -> PagedSequence:
        return PagedSequence(self.pool, reserve_tokens)

    def release(self, state: PagedSequence) -> None:
        super().release(state)
        state.release()

    @torch.inference_mode()
    def draft(self, state: PagedSequence, committed: list[int], spec: DraftSpec,
              generator: torch.Generator) -> Proposal:
        """One request's draft on this thread, its forwards gathered with other threads' by the batcher."""
        with self.batcher.participant():  # batches wait for this request's next level
            program = self.draft_program(state, committed, spec, generator)
            return drive(program, lambda forward: self.batcher.submit(forward.item))

    def _extend_program(self, state: PagedSequence, committed: list[int]) -> Program:  # -> ([V], fed)
        state.truncate(min(state.length, len(committed) - 1))
        # the request's first draft feeds its prompt; later ones the few tokens the last step accepted
        tokens = committed[state.length:]
        began = self.batcher.clock() if self.batcher.chunk_tokens and state.length == 0 else None
        logits = yield from feed_program(self.packed, state, tokens, self.batcher.chunk_tokens, began)
        return logits, len(tokens)

    def _level_program(self, state: PagedSequence, builder: TreeBuilder, level: list[int], cached: list[int],
                       depth: int, committed_length: int) -> Program:  # -> [F, V]
        visible = level_visibility(builder, level, cached)  # [F, K]
        tokens = torch.tensor([builder.tokens[n] for n in level], dtype=torch.long)
        item = ForwardItem(state, tokens, torch.full_like(tokens, committed_length - 1 + depth), visible,
                           torch.arange(len(level)))
        return (yield Forward(self.packed, item)).cpu()

    def rollback(self, state: PagedSequence, length: int) -> None:
        state.truncate(length)

    def forward_tokens(self, state: PagedSequence, tokens: list[int]) -> torch.Tensor:  # -> [G, V]
        """The SSM's logits after each of ``tokens`` fed after the committed ones (one packed forward
        with whoever else submits); the sequence is left as it was."""
        logits = self.batcher.submit(chain_item(state, tokens, last_only=False))  # [G, V]
        state.truncate(state.length)
        return logits.float().cpu()

    def save_entries(self, state: PagedSequence, start: int) -> SavedEntries:
        """The committed entries from ``start`` on, copied into blocks of their own (PoolExhausted
        when the pool has none unreserved)."""
        return state.save(start)

    def restore_entries(self, state: PagedSequence, start: int, saved: SavedEntries) -> None:
        state.restore(start, saved)

    def drop_entries(self, state: PagedSequence, saved: SavedEntries) -> None:
        state.drop(saved)


def feed(batcher: ForwardBatcher, state: PagedSequence, tokens: list[int],
         prompt: bool = False) -> torch.Tensor:  # -> [V]
    """Commit ``tokens`` to ``state`` (a prompt, or what its cache lacks); the logits after the last.

    Chunked prefill: chunks of at most ``batcher.chunk_tokens``, each committed before the next is
    submitted. A ``prompt``'s chunks are marked with the moment it began and the tokens it has
    left (``PromptChunk``), and the batcher puts at most ``chunk_tokens`` prompt tokens (all
    requests together, in ``ForwardBatcher.prompt_order``) in one packed forward; other feeds (the
    few tokens a step accepted) always go. So the other running requests' forwards run beside a
    long prompt's chunks instead of waiting for the whole prompt, and prompts that arrive together
    are prefilled a chunk budget at a time, the shortest first, not all in one forward that delays
    every first token. Example: 10 tokens, chunks of 4 -> forwards of 4, 4 and 2 tokens.
    """
    since = batcher.clock() if batcher.chunk_tokens and prompt else None
    program = feed_program(batcher.model, state, tokens, batcher.chunk_tokens, since)
    return drive(program, lambda forward: batcher.submit(forward.item))


def feed_program(runner: PackedModel, state: PagedSequence, tokens: list[int], chunk_tokens: int | None = None,
                 began: float | None = None) -> Program:  # -> [V]
    """``feed`` as a program: one forward per chunk of at most ``chunk_tokens`` tokens (None: one for
    all), each chunk committed before the next is yielded. With ``began`` (the moment the prompt
    began feeding) each chunk is marked as a prompt chunk (``PromptChunk``). Returns the logits [V]
    after the last token."""
    if not tokens:
        raise ValueError("feed needs at least one token (the root)")
    size = chunk_tokens or len(tokens)
    for start in range(0, len(tokens), size):
        chunk = tokens[start:start + size]
        marked = None if began is None else PromptChunk(began, len(tokens) - start)
        logits = yield Forward(runner, chain_item(state, chunk, prompt=marked))  # [1, V]
        state.keep(list(range(len(chunk))))
    return logits[0].cpu()


def tree_item(state: PagedSequence, tree: TokenTree) -> ForwardItem:
    """A tree after the sequence's committed tokens: positions prefix + depth, the ancestor mask."""
    return ForwardItem(state, tree.tokens, positions(tree.parents, state.length), ancestor_mask(tree.parents),
                       torch.arange(tree.size))


def paged_parts(model, tokens: int, block_size: int = 16, waits: BatchWaits = BatchWaits(), expected=None,
                chunk_tokens: int | None = None) -> tuple[BlockPool, ForwardBatcher]:
    """A pool of ``tokens`` slots for ``model`` and a batcher over it (in this process)."""
    pool = BlockPool.for_tokens(tokens, block_size)
    return pool, ForwardBatcher(PagedModel(model, pool), waits, expected, chunk_tokens)


# An SSM's pool against the target's: its requests' contexts plus the levels its drafts feed.
SSM_POOL_SCALE = 1.25


def paged_target(model, tokens: int, block_size: int = 16) -> PagedTarget:
    """The target over a pool of ``tokens`` slots, in this process (the batched in-process engine)."""
    pool, batcher = paged_parts(model, tokens, block_size)
    return PagedTarget(model, pool, batcher)


def paged_drafter(model, proposer: int, name: str, target_tokens: int, block_size: int = 16,
                  chunk_tokens: int | None = None) -> PagedDrafter:
    """An SSM drafting over its own pool, ``SSM_POOL_SCALE`` x the target's ``target_tokens`` slots."""
    pool, batcher = paged_parts(model, int(target_tokens * SSM_POOL_SCALE), block_size, chunk_tokens=chunk_tokens)
    return PagedDrafter(model, proposer, name, pool, batcher)


def forward_or_raise(model: PackedModel, items: list[ForwardItem]) -> list[torch.Tensor]:  # -> per item [r, V]
    """One packed forward; the first item's own error is raised (that item did not run)."""
    results = model.forward(items)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def time_packed_forward(model: PackedModel, total_tokens: int, prefix: int = 256, repeats: int = 3) -> float:
    """Median ms of one packed forward of ``total_tokens`` chain tokens on a ``prefix`` cache
    (a forward that failed for its item raises: it did not run, so it cannot be timed)."""
    with packed_timer(model, prefix, repeats) as time_pass:
        return time_pass(total_tokens)


@contextmanager
def packed_timer(model: PackedModel, prefix: int = 256, repeats: int = 3):
    """``time_pass(total_tokens)`` -> median ms of ``repeats`` packed forwards of a chain on one
    ``prefix``-token sequence, prefilled once (a curve of many sizes pays one prefill)."""
    sequence = PagedSequence(model.pool)

    def time_pass(total_tokens: int) -> float:
        def run() -> None:
            forward_or_raise(model, [chain_item(sequence, list(range(total_tokens)), last_only=False)])
            sequence.truncate(prefix)  # block bookkeeping only: well under a ms of a forward's time

        return median_ms(run, repeats)

    try:
        forward_or_raise(model, [chain_item(sequence, list(range(prefix)))])
        sequence.keep(list(range(prefix)))
        yield time_pass
    finally:
        sequence.release()
