"""Statistics of one run: per-prompt ratios to and divergence from ``incremental``, and per-method
medians (with their spread), accepted lengths, acceptance by depth and per-proposer credit."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from .methods import BASELINE, PEER, Method
from .rows import BenchRow
from .workloads import EncodedPrompt, pass_of


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first token where ``other`` differs from ``reference``; None when identical.

    Example: [1, 2, 3] vs [1, 2, 4] -> 2; [1, 2] vs [1, 2, 3] -> 2; [1, 2] vs [1, 2] -> None.
    """
    for index, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return index
    return None if len(reference) == len(other) else min(len(reference), len(other))


def accepted_length_counts(accepted_per_depth: Sequence[int], verify_steps: int) -> list[int]:
    """How many verify steps accepted 0, 1, 2, ... draft tokens, from the per-depth counts.

    Exact: a step that accepts L tokens credits depths 1..L once each, so the number of steps that
    reached depth d is accepted_per_depth[d-1]. Example: per depth [5, 2], 8 steps -> [3, 3, 2].
    """
    reached = [verify_steps, *accepted_per_depth, 0]
    return [reached[d] - reached[d + 1] for d in range(len(reached) - 1)]


def _median(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if len(values) else None


def _spread(values: Sequence[float]) -> dict | None:
    if not len(values):
        return None
    p25, p75 = np.percentile(values, [25, 75])
    return {"p25": float(p25), "p75": float(p75), "min": float(min(values)), "max": float(max(values))}


def _ratio(reference: BenchRow | None, row: BenchRow) -> float | None:
    """How many times faster than ``reference`` (ms per token) ``row`` ran; None without a reference."""
    return reference.ms_per_token / row.ms_per_token if reference and row.ms_per_token > 0 else None


def prompt_record(row: BenchRow, baseline: BenchRow | None, peer: BenchRow | None = None) -> dict:
    """A per-prompt row with its ratio to and divergence from the baseline on the same prompt, and its
    ratio to the peer (transformers' assisted generation) there when the run has it."""
    record = row.to_json()
    record["speedup_vs_incremental"] = _ratio(baseline, row)
    record["speedup_vs_hf_assisted"] = _ratio(peer, row)
    record["matches_incremental"] = baseline.token_ids == row.token_ids if baseline else None
    record["first_divergence"] = first_divergence(baseline.token_ids, row.token_ids) if baseline else None
    has_depths = row.accepted_per_depth is not None and row.target_steps
    record["accepted_lengths"] = (accepted_length_counts(row.accepted_per_depth, row.target_steps - 1)
                                  if has_depths else None)
    return record


def _sum_lists(lists: Iterable[Sequence[int]]) -> list[int]:
    total: list[int] = []
    for values in lists:
        total.extend([0] * (len(values) - len(total)))
        for index, value in enumerate(values):
            total[index] += value
    return total


def acceptance_summary(records: Sequence[dict]) -> dict:
    """Accepted-length histogram, acceptance by depth and per-proposer credit, summed over prompts."""
    engine = [r for r in records if r["accepted_lengths"] is not None]
    if not engine:
        return {"accepted_length_histogram": None, "acceptance_by_depth": None, "accepted_per_proposer": None,
                "proposer_share": None, "mean_accepted_per_step": None}
    steps = sum(r["target_steps"] - 1 for r in engine)
    per_depth = _sum_lists(r["accepted_per_depth"] for r in engine)
    per_proposer: dict[str, int] = {}
    for r in engine:
        for name, count in (r["accepted_per_proposer"] or {}).items():
            per_proposer[name] = per_proposer.get(name, 0) + count
    accepted = sum(per_depth)
    return {"accepted_length_histogram": _sum_lists(r["accepted_lengths"] for r in engine),
            "acceptance_by_depth": [count / steps if steps else 0.0 for count in per_depth],
            "accepted_per_proposer": per_proposer,
            "proposer_share": {n: c / accepted for n, c in per_proposer.items()} if accepted else {},
            "mean_accepted_per_step": accepted / steps if steps else 0.0}


def method_summary(records: Sequence[dict]) -> dict:
    """Medians over prompts (and their spread) of one method's per-prompt figures."""
    series = {key: [r[key] for r in records if r[key] is not None]
              for key in ("tokens_per_step", "ms_per_token", "speedup_vs_incremental", "speedup_vs_hf_assisted")}
    matches = [r["matches_incremental"] for r in records if r["matches_incremental"] is not None]
    summary = {"prompts": len(records), **{key: _median(values) for key, values in series.items()},
               "outputs_match_incremental": sum(matches) / len(matches) if matches else None,
               "first_divergence": {r["prompt_id"]: r["first_divergence"] for r in records},
               "spread": {key: _spread(values) for key, values in series.items()},
               "new_tokens": sum(r["new_tokens"] for r in records)}
    times = [(r["draft_ms"], r["verify_ms"]) for r in records if r["draft_ms"] is not None]
    busy = sum(d + v for d, v in times)
    summary["draft_time_share"] = sum(d for d, _ in times) / busy if busy else None
    return {**summary, **step_profile(records), **acceptance_summary(records)}


def step_profile(records: Sequence[dict]) -> dict:
    """Per verify step, over all prompts: tree nodes (draft tokens), drafting ms (draft, merge and
    transport), verify ms, and of the drafting the transport's ms (actor calls, scheduling,
    serialisation: ``hop_ms``; None where rows lack it); None for methods without engine
    statistics (hf-assisted).

    Example: two prompts of 11 and 21 target steps (30 verify steps), 300 draft tokens, 600 ms of
    drafting (150 of it transport) and 3000 ms of verifying -> 10 nodes, 20 ms, 100 ms and 5 ms per step.
    """
    engine = [r for r in records if r["draft_tokens"] is not None and r["target_steps"]]
    steps = sum(r["target_steps"] - 1 for r in engine)
    if not steps:
        return dict.fromkeys(("nodes_per_step", "draft_ms_per_step", "verify_ms_per_step", "transport_ms_per_step"))
    hops = [r.get("hop_ms") for r in engine]
    return {"nodes_per_step": sum(r["draft_tokens"] for r in engine) / steps,
            "draft_ms_per_step": sum(r["draft_ms"] for r in engine) / steps,
            "verify_ms_per_step": sum(r["verify_ms"] for r in engine) / steps,
            "transport_ms_per_step": None if None in hops else sum(h["transport"] for h in hops) / steps}


def summarize(rows: dict[tuple[str, str], BenchRow], methods: Sequence[Method], workload: Sequence[EncodedPrompt],
              proposer_names: Sequence[str]) -> dict:
    """The results' ``per_prompt`` rows (in workload order) and ``summary`` keyed by method spelling."""
    per_prompt = []
    for prompt in workload:
        baseline, peer = rows.get((prompt.id, BASELINE)), rows.get((prompt.id, PEER))
        per_prompt += [prompt_record(rows[(prompt.id, m.spelling)], baseline, peer) for m in methods
                       if (prompt.id, m.spelling) in rows]
    summary = {m.spelling: {"proposers": m.proposers(proposer_names),
                            **method_summary([r for r in per_prompt if r["method"] == m.spelling])} for m in methods}
    return {"summary": summary, "per_prompt": per_prompt}


def pass_summary(per_prompt: Sequence[dict], methods: Sequence[Method]) -> list[dict]:
    """Per pass of a repeated workload (``bench.workloads.repeat_workload``) and method: the
    medians of ``method_summary`` and the proposers' shares, so the passes can be compared (what
    the suffix proposer's global store of earlier responses adds on the second pass)."""
    rows = []
    for number in sorted({pass_of(r["prompt_id"]) for r in per_prompt}):
        for m in methods:
            records = [r for r in per_prompt if r["method"] == m.spelling and pass_of(r["prompt_id"]) == number]
            if records:
                summary = method_summary(records)
                rows.append({"pass": number, "method": m.spelling,
                             **{k: summary[k] for k in ("prompts", "speedup_vs_incremental", "tokens_per_step",
                                                        "ms_per_token", "outputs_match_incremental",
                                                        "nodes_per_step", "proposer_share")}})
    return rows

