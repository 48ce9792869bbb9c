"""What one engine-loop iteration sends each actor (``actors.executor.ActorExecutor``): one call per
actor per phase, carrying every request's part.

SSM and merge jobs carry only the committed tokens the actor has not been sent (``start`` and
``new_tokens``, as ``actors.common.sync_history`` applies them); an actor that lacks the start
answers NeedsResync for that job alone, and the executor sends the whole history next time.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling import SamplingParams
from engine.step import Assignment


@dataclass(frozen=True)
class SSMJob:
    """One request's draft in an SSM actor this iteration."""

    request_id: str
    start: int
    new_tokens: tuple[int, ...]
    assignment: Assignment


@dataclass(frozen=True)
class MergeJob:
    """One request's merge: its plan (proposer order) and, for each neural assignment in it, where
    its draft is among the SSM calls' results: (call, position)."""

    request_id: str
    start: int
    new_tokens: tuple[int, ...]
    plan: tuple[Assignment, ...]
    places: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TreeJob:
    """One request's verify: its root (the last committed token), for a root-only tree when no
    merged tree came (plain decoding that step: lossless)."""

    request_id: str
    root: int


@dataclass(frozen=True)
class PrefillJob:
    """One request's next prompt chunk; ``first``: its state is made (``reserve_tokens`` reserved)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    reserve_tokens: int
    first: bool


@dataclass(frozen=True)
class StepReply:
    """The verifier's answer: per request its result (``engine.loop.Executor.verify``), the requests
    whose drafts need the whole history next time, the pool's (used, total) blocks, and the ms the
    call ran in the verifier (its drafts were in by then: Ray resolves the merge actor's reference
    first)."""

    results: dict
    resync: tuple[str, ...]
    kv_blocks: tuple[int, int] | None
    call_ms: float = 0.0
