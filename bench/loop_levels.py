"""One load level on an engine loop, measured, and its figures: what ``bench.loop_load`` (the
configured models on this machine) and ``bench/gpu_loop.py`` (planted models on a GPU) share.

It imports no Ray, no config and no tokenizer: the GPU machine has torch and transformers only.
A level is S busy streams (``measure_level``); its runs pool per method (``pooled``,
``level_figures``), and the summary sets each method against incremental decoding and the plain
pass's limit from the verify-cost curve (``summarise``, ``markdown``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from engine.loop import PHASES, IterationStats
from engine.requests import GenerationRequest, SpeculationOptions

from .method_names import BASELINE
from .workloads import EncodedPrompt


class LevelMethod(Protocol):
    """What a level needs of a method (``bench.methods.Method`` is one): its label and options."""

    spelling: str
    options: SpeculationOptions


@dataclass(frozen=True)
class LevelRun:
    """One run of a level, as measured: its label, wall time, and per request its new tokens, ms to
    its first token and its output; the loop's iterations."""

    method: str
    streams: int
    wall_s: float
    tokens: dict
    first: dict
    iterations: list
    outputs: dict


def measure_level(engine, method: LevelMethod, workload: Sequence[EncodedPrompt], streams: int, max_new_tokens: int,
                  gated: bool = True, per_stream: int = 1) -> LevelRun:
    """S busy streams: S requests submitted at once and, as each finishes, the stream's next, until
    ``per_stream`` x S requests (the workload's prompts cycled) have finished; the loop stepped
    meanwhile. ``gated``: with the engine's draft gate (it persists across levels, as in a server),
    else with none. The first token's ms count from the request's submission."""
    loop, seen, gate = engine.loop, [], engine.loop.gate
    loop.gate = gate if gated else None
    loop.observers.append(seen.append)
    prompts = [workload[i % len(workload)].ids for i in range(streams * per_stream)]
    try:
        began, submitted, first, tokens, outputs = time.perf_counter(), {}, {}, {}, {}

        def submit() -> None:
            request_id = loop.submit(GenerationRequest(prompts[len(submitted)], max_new_tokens,
                                                       speculation=method.options))
            submitted[request_id], tokens[request_id], outputs[request_id] = time.perf_counter(), 0, []
        for _ in range(streams):
            submit()
        while loop.has_work:
            loop.step()
            for request_id in [i for i in submitted if i in loop.requests]:
                for update in loop.take(request_id):
                    if update.token_ids and request_id not in first:
                        first[request_id] = (time.perf_counter() - submitted[request_id]) * 1e3
                    tokens[request_id] += len(update.token_ids)
                    outputs[request_id].extend(update.token_ids)
                    if update.finish_reason is not None and len(submitted) < len(prompts):
                        submit()
        wall_s = time.perf_counter() - began
    finally:
        loop.observers.remove(seen.append)
        loop.gate = gate
    label = method.spelling if gated or method.spelling == BASELINE else f"{method.spelling} (no gate)"
    return LevelRun(label, streams, wall_s, tokens, first, seen, outputs)


def variants(methods: Sequence[LevelMethod], gate_ab: bool) -> list[tuple[LevelMethod, bool]]:
    """(method, gated) runs per level: each method with the gate; with ``gate_ab`` every method but
    the baseline without it too, right after it."""
    return [(m, gated) for m in methods for gated in ((True, False) if gate_ab and m.spelling != BASELINE else (True,))]


def grouped(runs: Sequence[LevelRun]) -> list[list[LevelRun]]:
    """The runs of each (method, level), in the order first met."""
    groups: dict[tuple[str, int], list[LevelRun]] = {}
    for run in runs:
        groups.setdefault((run.method, run.streams), []).append(run)
    return list(groups.values())


def pooled(group: Sequence[LevelRun]) -> LevelRun:
    """Runs of one (method, level) as one: wall times, tokens, first tokens and iterations together
    (requests keyed by (run, id)); the first run's outputs."""
    return LevelRun(group[0].method, group[0].streams, sum(r.wall_s for r in group),
                    {(i, k): v for i, r in enumerate(group) for k, v in r.tokens.items()},
                    {(i, k): v for i, r in enumerate(group) for k, v in r.first.items()},
                    [s for r in group for s in r.iterations], group[0].outputs)


def level_figures(runs: Sequence[LevelRun]) -> dict:
    """A level's figures over its repeated runs (one method) pooled: tokens per second is every
    run's tokens over every run's wall time; ``runs_tokens_per_s``: each run's own."""
    run = pooled(runs)
    total, iterations = sum(run.tokens.values()), run.iterations
    return {"method": run.method, "streams": run.streams, "wall_s": run.wall_s, "new_tokens": total,
            "repeats": len(runs), "runs_tokens_per_s": [sum(r.tokens.values()) / r.wall_s for r in runs],
            "aggregate_tokens_per_s": total / run.wall_s, "ttft_ms_p50": statistics.median(run.first.values()),
            "iterations": len(iterations), "tokens_per_pass": total / len(iterations),
            "drafted_per_iteration": statistics.fmean(s.drafted_tokens for s in iterations),
            "drafts_per_iteration": statistics.fmean(s.drafts for s in iterations),
            "running_mean": statistics.fmean(s.running for s in iterations),
            "phase_ms": phase_means(iterations), "profile": split_profile(iterations),
            "outputs": {str(k): v for k, v in run.outputs.items()}}


def phase_means(iterations: Sequence[IterationStats]) -> dict[str, float]:
    """Mean ms per phase of an iteration (zeros for none)."""
    return {phase: statistics.fmean(s.ms[phase] for s in iterations) if iterations else 0.0 for phase in PHASES}


def split_profile(iterations: Sequence[IterationStats]) -> dict:
    """Where a level's time goes: the iterations whose pass fed prompt chunks (``prefill``) and the
    others (``decode``), each with its count, seconds, tokens emitted, mean running requests and mean
    ms per phase; decode's tokens per second. Example: two decode iterations of 300 ms emitting 8
    tokens each and one prefill of 1,200 ms -> decode 2 iterations, 0.6 s, 16 tokens, 26.7 tok/s."""
    profile = {}
    for part, chosen in (("prefill", [s for s in iterations if s.prompt_tokens]),
                         ("decode", [s for s in iterations if not s.prompt_tokens])):
        seconds = sum(sum(s.ms.values()) for s in chosen) / 1e3
        emitted = sum(s.emitted_tokens for s in chosen)
        profile[part] = {"iterations": len(chosen), "seconds": seconds, "emitted_tokens": emitted,
                         "running_mean": statistics.fmean(s.running for s in chosen) if chosen else 0.0,
                         "phase_ms": phase_means(chosen)}
    decode = profile["decode"]
    decode["tokens_per_s"] = decode["emitted_tokens"] / decode["seconds"] if decode["seconds"] else None
    return profile


def forward_limit(curve: dict[int, float] | None, streams: int) -> float | None:
    """Tokens per second of plain decoding at ``streams`` requests: S tokens per pass at the curve's
    cost of an S-token pass (linear between measured sizes); None past the curve or without one.
    Example: {1: 200, 8: 320}, 4 streams -> 4 / 0.2514 s = 15.9."""
    if not curve:
        return None
    sizes = sorted(curve)
    if streams in curve:
        return streams * 1e3 / curve[streams]
    below = [s for s in sizes if s < streams]
    above = [s for s in sizes if s > streams]
    if not below or not above:
        return None
    lo, hi = below[-1], above[0]
    ms = curve[lo] + (curve[hi] - curve[lo]) * (streams - lo) / (hi - lo)
    return streams * 1e3 / ms


def summarise(levels: list[dict], curve: dict[int, float] | None) -> list[dict]:
    """Per level: each method's figures and its ratio against incremental's aggregate tokens/s."""
    rows = []
    for level in levels:
        base = next((l for l in levels if l["streams"] == level["streams"] and l["method"] == BASELINE), None)
        row = {k: v for k, v in level.items() if k != "outputs"}
        row["vs_incremental"] = level["aggregate_tokens_per_s"] / base["aggregate_tokens_per_s"] if base else None
        if level["method"] == BASELINE:
            limit = forward_limit(curve, level["streams"])
            row["forward_limit_tokens_per_s"] = limit
            row["of_limit"] = level["aggregate_tokens_per_s"] / limit if limit else None
            decode = level["profile"]["decode"]  # incremental: one token per request in a pass
            batch = decode["emitted_tokens"] / decode["iterations"] if decode["iterations"] else None
            decode_limit = forward_limit(curve, batch) if batch else None
            row["decode_of_limit"] = decode["tokens_per_s"] / decode_limit if decode_limit else None
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| streams | method | tok/s | vs incremental | TTFT p50 ms | tokens/pass | prefill s | decode tok/s | "
             "decode draft ms | decode verify ms | of forward limit | decode of limit |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        prefill, decode = r["profile"]["prefill"], r["profile"]["decode"]
        share = lambda key: f"{r[key]:.2f}" if r.get(key) else ""  # noqa: E731
        lines.append(f"| {r['streams']} | {r['method']} | {r['aggregate_tokens_per_s']:.2f} | {r['vs_incremental']:.2f} "
                     f"| {r['ttft_ms_p50']:.0f} | {r['tokens_per_pass']:.2f} | {prefill['seconds'] / r['repeats']:.1f} | "
                     f"{decode['tokens_per_s'] or 0:.2f} | {decode['phase_ms']['draft']:.0f} | "
                     f"{decode['phase_ms']['verify']:.0f} | {share('of_limit')} | {share('decode_of_limit')} |")
    return "\n".join(lines) + "\n"
