"""`specinfer bench`: decoding methods compared on one workload, prompt by prompt, in one process.

Method spellings (``--methods``, comma-separated):

* ``incremental``: plain decoding by the target (the baseline every ratio is taken against).
* ``sequence`` / ``sequence:K``: one chain of depth K (default: the config's ``sequence_depth``)
  from the first neural SSM: classical speculative decoding.
* ``tree`` / ``tree:K1-K2-...``: a token tree from the **first neural SSM only**, with the config's
  expansion schedule or the one given.
* ``ensemble`` / ``ensemble:K1-K2-...``: a tree from **every** configured proposer (all SSMs and the
  n-gram proposer), merged: what ``specinfer generate --mode tree`` does.
* ``tree[a,b]`` / ``tree[a,b]:K1-...``: a tree from the named proposers only (``specinfer experiment``
  spells its runs this way); ``sequence[a]:K`` picks the chain's SSM.
* a ``+RULE`` suffix on tree / ensemble spellings picks the child rule when sampling
  (``--temperature > 0``): ``tree+top_k``, ``tree+sampled``, ``tree+sampled_without_replacement``.
  Greedy requests always take top-k children, so the suffix changes nothing there.
* ``hf-assisted``: transformers ``generate(assistant_model=<first neural SSM>)`` with its default
  assistant settings (the peer a CPU user would pick); target forwards are counted with a hook.

Each (prompt, method) result is appended to ``OUT/rows.jsonl`` as soon as it exists, and a rerun
skips the pairs already there, so an interrupted run resumes. ``OUT/results.json`` (per-prompt
rows and a per-method summary), ``OUT/results.md`` and PNG plots are rewritten at the end. With
``--via grpc ADDRESS --concurrency 1,2,4,8`` load levels follow (``cluster/bench_load.py``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import platform
import re
import time
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Protocol, Sequence

import numpy as np

from engine.draft import CHILDREN_RULES
from engine.generate import GenerationRequest, SpeculationOptions
from engine.sampling import SamplingParams

from settings.config import EngineConfig, load_config
from .datasets import DEFAULT_MAX_PROMPT_TOKENS, EncodedPrompt, load_workload

logger = logging.getLogger(__name__)

BASELINE = "incremental"
GREEDY_METHODS = ("incremental", "sequence:4", "tree", "ensemble", "hf-assisted")
SAMPLED_METHODS = ("incremental", "sequence:4", "tree+top_k", "tree+sampled", "tree+sampled_without_replacement",
                   "hf-assisted")
SPELLINGS = ("incremental, sequence[:K], tree[:K1-K2-...], ensemble[:K1-K2-...], tree[ssm,...][:K1-...], "
             "a +top_k / +sampled / +sampled_without_replacement suffix on tree and ensemble, hf-assisted")


# ----------------------------------------------------------------------------------------------
# Methods


@dataclass(frozen=True)
class Proposers:
    """The proposers a config declares, in engine order (neural SSMs first, then n-gram)."""

    names: tuple[str, ...]
    neural: tuple[bool, ...]

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Proposers":
        names = [m.name for m in config.ssms] + ([config.ngram.name] if config.ngram else [])
        return cls(tuple(names), tuple([True] * len(config.ssms) + [False] * (config.ngram is not None)))

    def first_neural(self, spelling: str) -> str:
        for name, neural in zip(self.names, self.neural):
            if neural:
                return name
        raise ValueError(f"method {spelling!r} needs a neural SSM, and the config has none")

    def pick(self, listed: str | None, spelling: str) -> tuple[str, ...] | None:
        """Names from a ``[a,b]`` list (None when absent); unknown names raise ValueError."""
        if listed is None:
            return None
        names = tuple(n.strip() for n in listed.split(",") if n.strip())
        unknown = sorted(set(names) - set(self.names))
        if not names or unknown:
            raise ValueError(f"method {spelling!r}: unknown or no proposer names {unknown}; known: {list(self.names)}")
        return names


@dataclass(frozen=True)
class Method:
    """A decoding method: engine options, or transformers' assisted generation with one SSM."""

    spelling: str
    kind: str  # "engine" | "hf-assisted"
    options: SpeculationOptions | None = None
    assistant: str | None = None


_TREE = re.compile(r"(?P<kind>tree|ensemble)(?:\[(?P<names>[^\]]*)\])?(?::(?P<schedule>\d+(?:-\d+)*))?"
                   r"(?:\+(?P<rule>\w+))?")
_SEQUENCE = re.compile(r"sequence(?:\[(?P<names>[^\]]*)\])?(?::(?P<depth>\d+))?")


def parse_method(spelling: str, proposers: Proposers, base: SpeculationOptions) -> Method:
    """One method spelling (see the module docstring); ValueError names the accepted spellings."""
    if spelling == "incremental":
        return Method(spelling, "engine", replace(base, mode="incremental", proposers=None))
    if spelling == "hf-assisted":
        return Method(spelling, "hf-assisted", assistant=proposers.first_neural(spelling))
    if match := _SEQUENCE.fullmatch(spelling):
        names = proposers.pick(match["names"], spelling) or (proposers.first_neural(spelling),)
        depth = int(match["depth"]) if match["depth"] else base.sequence_depth
        if depth < 1:
            raise ValueError(f"method {spelling!r}: the depth must be >= 1")
        return Method(spelling, "engine", replace(base, mode="sequence", sequence_depth=depth, proposers=names))
    if match := _TREE.fullmatch(spelling):
        names = proposers.pick(match["names"], spelling)
        if names is None and match["kind"] == "tree":
            names = (proposers.first_neural(spelling),)
        schedule = tuple(int(k) for k in match["schedule"].split("-")) if match["schedule"] else base.expansion
        rule = match["rule"] or base.children
        if rule not in CHILDREN_RULES or any(k < 1 for k in schedule):
            raise ValueError(f"method {spelling!r}: widths must be >= 1 and the rule one of {CHILDREN_RULES}")
        options = replace(base, mode="tree", expansion=schedule, children=rule, proposers=names)
        return Method(spelling, "engine", options)
    raise ValueError(f"unknown method {spelling!r}; spellings: {SPELLINGS}")


def resolve_methods(spellings: Sequence[str], config: EngineConfig, via: str | None = None) -> list[Method]:
    """Parse every spelling against the config; the baseline always runs (it is added first)."""
    from .build import speculation_options

    spellings = [s.strip() for s in spellings if s.strip()]
    if BASELINE not in spellings:
        spellings.insert(0, BASELINE)
    if len(set(spellings)) != len(spellings):
        raise ValueError(f"methods listed twice: {spellings}")
    methods = [parse_method(s, Proposers.from_config(config), speculation_options(config)) for s in spellings]
    if via and any(m.kind == "hf-assisted" for m in methods):
        raise ValueError("hf-assisted runs in-process only: drop it from --methods when using --via grpc")
    return methods


# ----------------------------------------------------------------------------------------------
# Rows


@dataclass(frozen=True)
class BenchRow:
    """One generation. ``ms_per_token``: wall time (prefill included) / new tokens; through gRPC it is
    the client's end-to-end time and ``server_ms_per_token`` the server's own figure."""

    prompt_id: str
    method: str
    prompt_tokens: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    new_tokens: int
    target_steps: int | None  # target forwards, prefill included
    tokens_per_step: float | None
    ms_per_token: float
    latency_ms: float
    draft_ms: float | None = None
    verify_ms: float | None = None
    draft_tokens: int | None = None
    accepted_per_proposer: dict[str, int] | None = None
    accepted_per_depth: tuple[int, ...] | None = None
    server_ms_per_token: float | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "BenchRow":
        values = {f.name: data.get(f.name) for f in fields(cls)}
        values["token_ids"] = tuple(values["token_ids"] or ())
        if values["accepted_per_depth"] is not None:
            values["accepted_per_depth"] = tuple(values["accepted_per_depth"])
        return cls(**values)


def row_from_stats(prompt: EncodedPrompt, method: str, token_ids: Sequence[int], finish_reason: str | None,
                   stats: dict, latency_ms: float, remote: bool = False) -> BenchRow:
    """A row from an engine stats dict (GenerationStats.to_dict() or the gRPC stats)."""
    new_tokens = len(token_ids)
    return BenchRow(
        prompt_id=prompt.id, method=method, prompt_tokens=len(prompt.ids), token_ids=tuple(token_ids),
        finish_reason=finish_reason, new_tokens=new_tokens, target_steps=int(stats["target_steps"]),
        tokens_per_step=float(stats["tokens_per_step"]),
        ms_per_token=latency_ms / max(new_tokens, 1) if remote else float(stats["ms_per_token"]),
        latency_ms=latency_ms, draft_ms=float(stats["draft_ms"]), verify_ms=float(stats["verify_ms"]),
        draft_tokens=int(stats["draft_tokens"]), accepted_per_proposer=dict(stats["accepted_per_proposer"]),
        accepted_per_depth=tuple(int(x) for x in stats["accepted_per_depth"]),
        server_ms_per_token=float(stats["ms_per_token"]) if remote else None)


class RowStore:
    """``rows.jsonl``: one JSON row per line, appended and fsynced one at a time.

    A cut-off last line (a run killed mid-write) is dropped and the file rewritten without it.
    """

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[tuple[str, str], BenchRow] = {}
        for row in self._load():
            self.rows[(row.prompt_id, row.method)] = row

    def _load(self) -> list[BenchRow]:
        if not self.path.exists():
            return []
        text = self.path.read_text(encoding="utf-8")
        lines = [line for line in text.splitlines() if line.strip()]
        rows = []
        for number, line in enumerate(lines, start=1):
            try:
                rows.append(BenchRow.from_json(json.loads(line)))
            except (json.JSONDecodeError, TypeError, KeyError) as error:
                if number < len(lines):
                    raise ValueError(f"{self.path}:{number}: corrupt row ({error}); remove the line") from None
                logger.warning("%s: dropping a cut-off last row", self.path)
        if text and (not text.endswith("\n") or len(rows) < len(lines)):
            self.path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in rows), encoding="utf-8")
        return rows

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self.rows

    def append(self, row: BenchRow) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row.to_json()) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.rows[(row.prompt_id, row.method)] = row


# ----------------------------------------------------------------------------------------------
# Runners


class Runner(Protocol):
    def run(self, method: Method, prompt: EncodedPrompt, max_new_tokens: int, sampling: SamplingParams) -> BenchRow:
        ...


class LocalRunner:
    """Runs methods on one in-process engine, built on first use (a finished run loads no model)."""

    def __init__(self, config: EngineConfig, engine=None):
        self.config, self._engine = config, engine

    @property
    def engine(self):
        if self._engine is None:
            from .build import build_engine

            self._engine = build_engine(self.config)
        return self._engine

    def run(self, method: Method, prompt: EncodedPrompt, max_new_tokens: int, sampling: SamplingParams) -> BenchRow:
        if method.kind == "hf-assisted":
            return hf_assisted_row(self.engine, method, prompt, max_new_tokens, sampling)
        request = GenerationRequest(prompt.ids, max_new_tokens, sampling, method.options)
        started = time.perf_counter()
        result = self.engine.generate(request)
        latency_ms = (time.perf_counter() - started) * 1e3
        return row_from_stats(prompt, method.spelling, result.token_ids, result.finish_reason,
                              result.stats.to_dict(), latency_ms)

    def close(self) -> None:
        if self._engine is not None:
            from .build import close_engine

            close_engine(self._engine)


def hf_generation_config(eos_ids: Iterable[int], max_new_tokens: int, sampling: SamplingParams):
    """A plain GenerationConfig (no penalties): greedy, or the request's temperature / top-k / top-p."""
    from transformers import GenerationConfig

    eos = sorted(eos_ids)
    values: dict = {"do_sample": not sampling.greedy, "max_new_tokens": max_new_tokens,
                    "eos_token_id": eos or None, "pad_token_id": eos[0] if eos else 0}
    if not sampling.greedy:
        values.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    return GenerationConfig(**values)


def hf_assisted_row(engine, method: Method, prompt: EncodedPrompt, max_new_tokens: int,
                    sampling: SamplingParams) -> BenchRow:
    """transformers' assisted generation with the SSM as assistant; a forward pre-hook counts target
    forwards (prefill included, as ``target_steps``). The assistant's generation config is restored
    after each call, so HF's adaptive draft length starts afresh for every prompt."""
    import torch

    target = engine.target.model
    if not isinstance(target, torch.nn.Module):
        raise ValueError("hf-assisted needs the target in this process: use verifier.tensor_parallel_size 1")
    assistant = engine.drafters[engine.names.index(method.assistant)].model
    config = hf_generation_config(engine.eos_ids, max_new_tokens, sampling)
    saved, calls = copy.deepcopy(assistant.generation_config), [0]
    hook = target.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    ids = torch.tensor([prompt.ids], dtype=torch.long)
    torch.manual_seed(sampling.seed or 0)
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                  assistant_model=assistant)
    finally:
        hook.remove()
        assistant.generation_config = saved
    latency_ms = (time.perf_counter() - started) * 1e3
    tokens = tuple(out[0, len(prompt.ids):].tolist())
    finish = "stop" if tokens and tokens[-1] in engine.eos_ids else "length"
    return BenchRow(prompt_id=prompt.id, method=method.spelling, prompt_tokens=len(prompt.ids), token_ids=tokens,
                    finish_reason=finish, new_tokens=len(tokens), target_steps=calls[0],
                    tokens_per_step=len(tokens) / calls[0] if calls[0] else None,
                    ms_per_token=latency_ms / max(len(tokens), 1), latency_ms=latency_ms)


def grpc_request(method: Method, prompt: EncodedPrompt, max_new_tokens: int, sampling: SamplingParams):
    """The GenerateRequest for one method and prompt (raw prompts as ``prompt``, chat prompts as one
    user message, so the server applies the same chat template)."""
    from .serve_client import build_request

    if method.kind != "engine":
        raise ValueError(f"{method.spelling} cannot run through gRPC")
    o, text = method.options, prompt.prompt.text
    return build_request(
        prompt=None if prompt.prompt.chat else text, messages=[("user", text)] if prompt.prompt.chat else (),
        max_new_tokens=max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, seed=sampling.seed, mode=o.mode, expansion=o.expansion, ssms=o.proposers or (),
        children=o.children, sequence_depth=o.sequence_depth)


class GrpcRunner:
    """Runs methods against a running server's Generate RPC (raw prompts as ``prompt``, chat prompts
    as one user message, so the server applies the same chat template)."""

    def __init__(self, address: str, timeout_s: float = 3600.0):
        from .serve_client import Client

        self.client, self.timeout_s = Client(address), timeout_s

    def run(self, method: Method, prompt: EncodedPrompt, max_new_tokens: int, sampling: SamplingParams) -> BenchRow:
        from .serve_client import response_dict

        request = grpc_request(method, prompt, max_new_tokens, sampling)
        started = time.perf_counter()
        response = self.client.generate(request, timeout=self.timeout_s)
        latency_ms = (time.perf_counter() - started) * 1e3
        data = response_dict(response)
        stats = {**data["stats"], "accepted_per_proposer": data["stats"]["accepted_per_ssm"]}
        return row_from_stats(prompt, method.spelling, data["token_ids"], data["finish_reason"], stats, latency_ms,
                              remote=True)

    def close(self) -> None:
        self.client.close()


# ----------------------------------------------------------------------------------------------
# Running


@dataclass(frozen=True)
class BenchSettings:
    config: str
    dataset: str
    out: Path
    methods: tuple[str, ...] = GREEDY_METHODS
    num_prompts: int = 20
    max_new_tokens: int = 128
    dtype: str | None = None
    sampling: SamplingParams = SamplingParams()
    via: str | None = None  # gRPC address; None: in-process
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    warmup_tokens: int = 16  # one short warm-up generation per method, not recorded; 0 disables
    concurrency: tuple[int, ...] = ()  # load-test levels (client streams kept busy); needs via
    requests: int | None = None  # requests per load level; None: max(prompts, largest level)
    label: str | None = None  # stored with the results, e.g. the server-side setting under test
    load_only: bool = False  # skip the per-prompt comparison (needs concurrency)

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.max_new_tokens < 1 or self.max_prompt_tokens < 1 or self.warmup_tokens < 0:
            raise ValueError("num_prompts, max_new_tokens and max_prompt_tokens must be >= 1, warmup_tokens >= 0")
        if self.concurrency and not self.via:
            raise ValueError("--concurrency needs --via grpc HOST:PORT: load tests run against a running server "
                             "(e.g. --via grpc 127.0.0.1:9000 --concurrency 1,2,4,8)")
        if self.load_only and not self.concurrency:
            raise ValueError("--load-only runs only the --concurrency levels: give --concurrency too")
        if any(level < 1 for level in self.concurrency) or len(set(self.concurrency)) != len(self.concurrency):
            raise ValueError(f"concurrency levels must be distinct and >= 1, got {list(self.concurrency)}")
        if self.requests is not None and (self.requests < 1 or not self.concurrency):
            raise ValueError("--requests (>= 1) sets the requests per --concurrency level: give --concurrency too")


def run_identity(settings: BenchSettings, config: EngineConfig) -> dict:
    """What rows of one output directory must share (methods and prompt count may grow)."""
    engine = config.model_dump(include={"dtype", "target", "ssms", "ngram", "speculation"}, mode="json")
    return {"dataset": settings.dataset, "max_new_tokens": settings.max_new_tokens,
            "max_prompt_tokens": settings.max_prompt_tokens, "sampling": asdict(settings.sampling),
            "via": settings.via, "engine": engine, **({"label": settings.label} if settings.label else {})}


def check_run_identity(path: Path, identity: dict) -> None:
    """Write ``run.json``, or refuse to mix rows into a directory made with other settings."""
    if path.exists():
        previous = json.loads(path.read_text(encoding="utf-8"))
        if previous != identity:
            changed = sorted(k for k in identity.keys() | previous.keys() if identity.get(k) != previous.get(k))
            raise ValueError(f"{path.parent} holds a run with other settings (changed: {', '.join(changed)}); "
                             "use another --out or delete that directory")
        return
    path.write_text(json.dumps(identity, indent=1) + "\n", encoding="utf-8")


def pending_pairs(methods: Sequence[Method], workload: Sequence[EncodedPrompt],
                  store: RowStore) -> list[tuple[EncodedPrompt, Method]]:
    """(prompt, method) pairs not yet in the store, prompt by prompt; the method order rotates by
    one each prompt so no method always runs first (or right after a given other one)."""
    pairs = []
    for index, prompt in enumerate(workload):
        shift = index % len(methods)
        for method in [*methods[shift:], *methods[:shift]]:
            if (prompt.id, method.spelling) not in store:
                pairs.append((prompt, method))
    return pairs


def execute(runner: Runner, pending: Sequence[tuple[EncodedPrompt, Method]], settings: BenchSettings,
            store: RowStore) -> None:
    """Warm every pending method up once (not recorded), then run the pairs with a progress bar."""
    from tqdm import tqdm

    if not pending:
        return
    if settings.warmup_tokens:
        warm = pending[0][0]
        for method in dict.fromkeys(m for _, m in pending):
            runner.run(method, warm, min(settings.warmup_tokens, settings.max_new_tokens), settings.sampling)
    with tqdm(total=len(pending), desc=f"bench {Path(settings.dataset).stem}", unit="gen", dynamic_ncols=True) as bar:
        for prompt, method in pending:
            bar.set_postfix_str(f"{prompt.id} {method.spelling}", refresh=False)
            store.append(runner.run(method, prompt, settings.max_new_tokens, settings.sampling))
            bar.update()


def load_tokenizer(config: EngineConfig):
    """The target's tokenizer alone (no weights): enough to build and key the workload."""
    from transformers import AutoTokenizer

    from engine.models import pretrained_args

    from .build import model_spec

    source, kwargs = pretrained_args(model_spec(config, config.target))
    return AutoTokenizer.from_pretrained(source, **kwargs)


def run_bench(settings: BenchSettings, config: EngineConfig | None = None, runner: Runner | None = None) -> dict:
    """Run (or resume) a benchmark and write rows.jsonl, results.json, results.md and the plots."""
    config = config or load_config(settings.config, dtype=settings.dtype)
    methods = resolve_methods(settings.methods, config, settings.via)
    workload = load_workload(settings.dataset, load_tokenizer(config), settings.num_prompts, settings.max_prompt_tokens)
    settings.out.mkdir(parents=True, exist_ok=True)
    check_run_identity(settings.out / "run.json", run_identity(settings, config))
    store = RowStore(settings.out / "rows.jsonl")
    pending = [] if settings.load_only else pending_pairs(methods, workload, store)
    created = bool(pending) and runner is None
    if created:
        runner = GrpcRunner(settings.via) if settings.via else LocalRunner(config)
    logger.info("%d of %d generations to run", len(pending), len(methods) * len(workload))
    try:
        execute(runner, pending, settings, store)
    finally:
        if created:
            runner.close()
    results = summarize(store.rows, methods, workload, settings, config)
    if settings.concurrency:
        from .bench_load import run_load

        results["load"] = run_load(settings, methods, workload)
    write_outputs(settings.out, results)
    return results


# ----------------------------------------------------------------------------------------------
# Summaries


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


def prompt_record(row: BenchRow, baseline: BenchRow | None) -> dict:
    """A per-prompt row with its ratio to and divergence from the baseline on the same prompt."""
    record = row.to_json()
    record["speedup_vs_incremental"] = (baseline.ms_per_token / row.ms_per_token
                                        if baseline and row.ms_per_token > 0 else None)
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
              for key in ("tokens_per_step", "ms_per_token", "speedup_vs_incremental")}
    matches = [r["matches_incremental"] for r in records if r["matches_incremental"] is not None]
    summary = {"prompts": len(records), **{key: _median(values) for key, values in series.items()},
               "outputs_match_incremental": sum(matches) / len(matches) if matches else None,
               "first_divergence": {r["prompt_id"]: r["first_divergence"] for r in records},
               "spread": {key: _spread(values) for key, values in series.items()},
               "new_tokens": sum(r["new_tokens"] for r in records)}
    times = [(r["draft_ms"], r["verify_ms"]) for r in records if r["draft_ms"] is not None]
    busy = sum(d + v for d, v in times)
    summary["draft_time_share"] = sum(d for d, _ in times) / busy if busy else None
    return {**summary, **acceptance_summary(records)}


def environment() -> dict:
    import torch
    import transformers

    return {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__}


def method_proposers(method: Method, names: Sequence[str]) -> list[str]:
    """The proposers a method drafts with (sequence mode: the first neural one it lists)."""
    if method.kind == "hf-assisted":
        return [method.assistant]
    options = method.options
    if options.mode == "incremental":
        return []
    listed = list(options.proposers) if options.proposers is not None else list(names)
    return listed[:1] if options.mode == "sequence" else listed


def summarize(rows: dict[tuple[str, str], BenchRow], methods: Sequence[Method], workload: Sequence[EncodedPrompt],
              settings: BenchSettings, config: EngineConfig) -> dict:
    """results.json: settings, environment, per-prompt rows and a summary keyed by method spelling."""
    per_prompt = []
    for prompt in workload:
        baseline = rows.get((prompt.id, BASELINE))
        per_prompt += [prompt_record(rows[(prompt.id, m.spelling)], baseline) for m in methods
                       if (prompt.id, m.spelling) in rows]
    names = Proposers.from_config(config).names
    summary = {m.spelling: {"proposers": method_proposers(m, names),
                            **method_summary([r for r in per_prompt if r["method"] == m.spelling])} for m in methods}
    run = {"config": settings.config, "dataset": settings.dataset, "num_prompts": len(workload),
           "max_new_tokens": settings.max_new_tokens, "dtype": config.dtype, "sampling": asdict(settings.sampling),
           "via": settings.via, "label": settings.label, "concurrency": list(settings.concurrency),
           "methods": [m.spelling for m in methods],
           "proposers": list(Proposers.from_config(config).names), "expansion": config.speculation.expansion}
    return {"settings": run, "environment": environment(), "summary": summary, "per_prompt": per_prompt}


def write_outputs(out: Path, results: dict) -> list[Path]:
    """results.json, results.md and the PNG plots (skipped with a warning without matplotlib)."""
    from .bench_report import write_markdown, write_plots

    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    plots = write_plots(out, results)
    write_markdown(out / "results.md", results, plots)
    return [out / "results.json", out / "results.md", *plots]
