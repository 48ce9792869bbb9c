"""Load levels of `specinfer bench --via grpc ADDRESS --concurrency 1,2,4,8`: running them, storing
them in ``load.jsonl`` and their figures.

For each concurrency level C and each method, C worker threads, each with its own gRPC ``Client``
(its own channel), keep C ``GenerateStream`` calls in flight: a worker takes the next request as
soon as its previous one ends. Every level runs the same requests: the workload's prompts cycled
(request i asks prompt i mod len(prompts)), ``requests`` of them (default: max(prompts, largest C)).
Workers connect before the level's clock starts; levels run in ascending C, the methods one after
the other within a level.

Figures per (method, level):

* ``aggregate_tokens_per_s``: new tokens of every successful request / wall time of the level
  (from the moment all C workers are connected until the last request has ended).
* ``ms_per_token_p50`` / ``_p95``: per request, (latency - time to first token) / (new tokens - 1),
  the time per output token after the first (vLLM's TPOT). Queueing and prefill show up in the
  time to first token only; requests with fewer than 2 new tokens are left out.
* ``ttft_ms_p50`` / ``_p95``: from sending the request to the first chunk that carries a token.
* ``tree_nodes_mean``, ``plain_step_share``: the tree sizes the server chose, over every verify
  step of the level (the final chunk's ``stats.tree_sizes``): mean drafted nodes per step, and the
  share of steps that drafted none.
* ``requests``, ``total_tokens``, ``errors`` (failed calls such as RESOURCE_EXHAUSTED, with a few
  distinct messages in ``error_examples``); failed requests count in no other figure.
* ``identical_across_concurrency`` (per method): every successful request of one prompt got the
  same token ids at every level (expected when greedy, and when sampling with a fixed seed).

Each level's requests are appended to ``OUT/load.jsonl`` when the level ends; a rerun skips the
levels already there (same method, C and requests per level).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from engine.sampling import SamplingParams

from .methods import Method
from .rows import append_json_line
from .runners import grpc_request
from .workloads import EncodedPrompt

logger = logging.getLogger(__name__)

MS_PER_TOKEN_DEFINITION = ("per request, (latency - time to first token) / (new tokens - 1): time per output "
                           "token after the first")
CONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class LoadRequest:
    """One request of a level. ``error``: ``CODE: details`` of a failed call, else None."""

    prompt_id: str
    token_ids: tuple[int, ...]
    ttft_ms: float | None
    latency_ms: float
    error: str | None = None
    tree_sizes: tuple[int, ...] = ()  # drafted nodes (root excluded) of each verify step, from the final stats

    @property
    def ms_per_token(self) -> float | None:
        """Time per output token after the first; None without two tokens."""
        if self.error is not None or self.ttft_ms is None or len(self.token_ids) < 2:
            return None
        return (self.latency_ms - self.ttft_ms) / (len(self.token_ids) - 1)


@dataclass(frozen=True)
class LoadLevel:
    """One (method, concurrency) level: its wall time and its requests in request order."""

    method: str
    concurrency: int
    wall_s: float
    requests: tuple[LoadRequest, ...]

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.method, self.concurrency, len(self.requests))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "LoadLevel":
        requests = tuple(LoadRequest(**{**r, "token_ids": tuple(r["token_ids"]),
                                        "tree_sizes": tuple(r.get("tree_sizes", ()))}) for r in data["requests"])
        return cls(data["method"], int(data["concurrency"]), float(data["wall_s"]), requests)


@dataclass(frozen=True)
class LoadPlan:
    """What every level of one run shares."""

    address: str
    max_new_tokens: int
    sampling: SamplingParams
    requests: int  # per level
    concurrency: tuple[int, ...]  # the levels, run in ascending order
    warmup_tokens: int = 16  # one unrecorded request per method before the first level; 0: none
    label: str | None = None  # stored with the results
    timeout_s: float = 3600.0


# ----------------------------------------------------------------------------------------------
# Running


def timed_stream(client, prompt_id: str, request, timeout_s: float) -> LoadRequest:
    """One GenerateStream call, timing its first token; an RPC error becomes the request's error."""
    import grpc

    token_ids: list[int] = []
    ttft_ms, sizes = None, ()
    started = time.perf_counter()
    try:
        for chunk in client.stream(request, timeout=timeout_s):
            if chunk.token_ids and ttft_ms is None:
                ttft_ms = (time.perf_counter() - started) * 1e3
            token_ids.extend(chunk.token_ids)
            if chunk.HasField("stats"):
                sizes = tuple(chunk.stats.tree_sizes)
    except grpc.RpcError as error:
        latency_ms = (time.perf_counter() - started) * 1e3
        return LoadRequest(prompt_id, tuple(token_ids), ttft_ms, latency_ms, f"{error.code().name}: {error.details()}")
    return LoadRequest(prompt_id, tuple(token_ids), ttft_ms, (time.perf_counter() - started) * 1e3, None, sizes)


def run_worker(plan: LoadPlan, jobs: queue.Queue, results: dict, start: threading.Barrier) -> None:
    """Connect, wait for the level's start, then take jobs until none are left."""
    import grpc

    from cluster.serve_client import Client

    with Client(plan.address) as client:
        try:
            grpc.channel_ready_future(client.channel).result(timeout=CONNECT_TIMEOUT_S)
        except grpc.FutureTimeoutError:
            logger.warning("%s: not connected after %.0f s; its requests will fail", plan.address, CONNECT_TIMEOUT_S)
        start.wait()
        while True:
            try:
                index, prompt_id, request = jobs.get_nowait()
            except queue.Empty:
                return
            results[index] = timed_stream(client, prompt_id, request, plan.timeout_s)


def run_level(plan: LoadPlan, method: Method, workload: Sequence[EncodedPrompt], concurrency: int) -> LoadLevel:
    """``plan.requests`` requests (prompts cycled) over ``concurrency`` busy client streams."""
    jobs: queue.Queue = queue.Queue()
    for index in range(plan.requests):
        prompt = workload[index % len(workload)]
        jobs.put((index, prompt.id, grpc_request(method, prompt, plan.max_new_tokens, plan.sampling)))
    results: dict[int, LoadRequest] = {}
    start = threading.Barrier(concurrency + 1, timeout=CONNECT_TIMEOUT_S + 60)
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="load") as pool:
        workers = [pool.submit(run_worker, plan, jobs, results, start) for _ in range(concurrency)]
        start.wait()
        began = time.perf_counter()
        for worker in workers:
            worker.result()  # re-raises a worker's unexpected error
        wall_s = time.perf_counter() - began
    return LoadLevel(method.spelling, concurrency, wall_s, tuple(results[i] for i in range(plan.requests)))


def warm_up(plan: LoadPlan, methods: Sequence[Method], prompt: EncodedPrompt, tokens: int) -> None:
    """One short unrecorded request per method, one at a time."""
    from cluster.serve_client import Client

    with Client(plan.address) as client:
        for method in methods:
            request = grpc_request(method, prompt, min(tokens, plan.max_new_tokens), plan.sampling)
            client.generate_streamed(request, timeout=plan.timeout_s)


class LevelStore:
    """``load.jsonl``: one finished level per line, keyed by (method, concurrency, requests)."""

    def __init__(self, path: Path):
        self.path = path
        self.levels: dict[tuple[str, int, int], LoadLevel] = {}
        lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        for number, line in enumerate(lines, start=1):
            try:
                level = LoadLevel.from_json(json.loads(line))
            except (json.JSONDecodeError, TypeError, KeyError):
                logger.warning("%s:%d: skipping an unreadable level (it is run again)", path, number)
                continue
            self.levels[level.key] = level

    def append(self, level: LoadLevel) -> None:
        append_json_line(self.path, level.to_json())
        self.levels[level.key] = level


def run_load(plan: LoadPlan, methods: Sequence[Method], workload: Sequence[EncodedPrompt], out: Path) -> dict:
    """Run the levels not yet in OUT/load.jsonl; return the results' ``load`` section."""
    from tqdm import tqdm

    levels = sorted(plan.concurrency)
    store = LevelStore(out / "load.jsonl")
    pending = [(c, m) for c in levels for m in methods if (m.spelling, c, plan.requests) not in store.levels]
    if pending and plan.warmup_tokens:
        warm_up(plan, list(dict.fromkeys(m for _, m in pending)), workload[0], plan.warmup_tokens)
    for concurrency, method in tqdm(pending, desc="load", unit="level", dynamic_ncols=True):
        store.append(run_level(plan, method, workload, concurrency))
    done = [store.levels[(m.spelling, c, plan.requests)] for m in methods for c in levels]
    return load_summary(done, plan.requests, plan.label)


# ----------------------------------------------------------------------------------------------
# Summaries


def percentiles(name: str, values: Sequence[float]) -> dict:
    """``{name}_p50`` and ``{name}_p95`` (None without values)."""
    if not len(values):
        return {f"{name}_p50": None, f"{name}_p95": None}
    p50, p95 = np.percentile(values, [50, 95])
    return {f"{name}_p50": float(p50), f"{name}_p95": float(p95)}


def level_summary(level: LoadLevel) -> dict:
    """One level's figures (see the module docstring)."""
    succeeded = [r for r in level.requests if r.error is None]
    tokens = sum(len(r.token_ids) for r in succeeded)
    per_token = [r.ms_per_token for r in succeeded if r.ms_per_token is not None]
    return {"method": level.method, "concurrency": level.concurrency, "requests": len(level.requests),
            "errors": len(level.requests) - len(succeeded),
            "error_examples": sorted({r.error for r in level.requests if r.error})[:3],
            "total_tokens": tokens, "wall_s": level.wall_s,
            "aggregate_tokens_per_s": tokens / level.wall_s if level.wall_s > 0 else None,
            **percentiles("ms_per_token", per_token),
            **percentiles("ttft_ms", [r.ttft_ms for r in succeeded if r.ttft_ms is not None]),
            **tree_size_summary([size for r in succeeded for size in r.tree_sizes])}


def tree_size_summary(sizes: Sequence[int]) -> dict:
    """The chosen tree sizes over a level's steps: mean drafted nodes per step (root excluded) and
    the share of steps that drafted none (plain decoding). Example: [0, 2, 4, 0] -> 1.5, 0.5."""
    if not sizes:
        return {"tree_nodes_mean": None, "plain_step_share": None}
    return {"tree_nodes_mean": float(np.mean(sizes)), "plain_step_share": sum(s == 0 for s in sizes) / len(sizes)}


def identical_across_concurrency(levels: Sequence[LoadLevel]) -> bool | None:
    """Whether every successful request of one prompt got the same tokens (None: none succeeded)."""
    outputs: dict[str, set[tuple[int, ...]]] = {}
    for level in levels:
        for request in level.requests:
            if request.error is None:
                outputs.setdefault(request.prompt_id, set()).add(request.token_ids)
    return all(len(seen) == 1 for seen in outputs.values()) if outputs else None


def load_summary(levels: Sequence[LoadLevel], requests: int, label: str | None) -> dict:
    """The results' ``load`` section; speedups are aggregate tokens/s over the same method's C = 1."""
    rows = [level_summary(level) for level in levels]
    single = {r["method"]: r["aggregate_tokens_per_s"] for r in rows if r["concurrency"] == 1}
    for row in rows:
        base, rate = single.get(row["method"]), row["aggregate_tokens_per_s"]
        row["speedup_vs_concurrency_1"] = rate / base if base and rate is not None else None
    methods = list(dict.fromkeys(level.method for level in levels))
    return {"label": label, "requests_per_level": requests,
            "concurrency": sorted({level.concurrency for level in levels}),
            "ms_per_token_definition": MS_PER_TOKEN_DEFINITION, "levels": rows,
            "identical_across_concurrency": {
                m: identical_across_concurrency([level for level in levels if level.method == m]) for m in methods}}
