"""One benchmark run: its settings, the resume checks and the order of work.

Each (prompt, method) result is appended to ``OUT/rows.jsonl`` as soon as it exists, and a rerun
skips the pairs already there, so an interrupted run resumes. ``OUT/results.json`` (per-prompt
rows and a per-method summary), ``OUT/results.md`` and PNG plots are rewritten at the end. With
``--via grpc ADDRESS --concurrency 1,2,4,8`` load levels follow (``bench/load.py``).
"""

from __future__ import annotations

import json
import logging
import os
import platform
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from engine.sampling import SamplingParams
from settings.config import EngineConfig, load_config

from .load import LoadPlan, run_load
from .machine import machine
from .methods import GREEDY_METHODS, Method, Proposers, resolve_methods
from .report import write_outputs
from .rows import RowStore
from .runners import GrpcRunner, LocalRunner, Runner
from .summary import pass_summary, summarize
from .workloads import DEFAULT_MAX_PROMPT_TOKENS, EncodedPrompt, load_workload, repeat_workload

logger = logging.getLogger(__name__)


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
    repeat: int = 1  # ask the workload this many times, pass after pass (bench.workloads.repeat_workload)

    def __post_init__(self) -> None:
        if self.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {self.repeat}")
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

    def load_plan(self, prompts: int) -> LoadPlan:
        """The load levels' plan; requests per level default to max(prompts, largest level)."""
        return LoadPlan(self.via, self.max_new_tokens, self.sampling, self.requests or max((prompts, *self.concurrency)),
                        self.concurrency, self.warmup_tokens, self.label)


def run_identity(settings: BenchSettings, config: EngineConfig) -> dict:
    """What rows of one output directory must share (methods and prompt count may grow)."""
    engine = config.model_dump(include={"dtype", "target", "ssms", "suffix", "speculation"}, mode="json")
    if any(_kernels_changed(config, model) for model in (config.target, *config.ssms)):
        engine["cpu_linears"] = config.cpu_linears  # unnamed otherwise: directories made before the setting resume
    return {"dataset": settings.dataset, "max_new_tokens": settings.max_new_tokens,
            "max_prompt_tokens": settings.max_prompt_tokens, "sampling": asdict(settings.sampling),
            "via": settings.via, "engine": engine, **({"label": settings.label} if settings.label else {}),
            **({"repeat": settings.repeat} if settings.repeat > 1 else {})}


def _kernels_changed(config: EngineConfig, model) -> bool:
    """Whether ``model`` runs on other CPU linear kernels than before ``cpu_linears`` existed (float32
    through plain oneDNN, other dtypes on torch's path). Under ``auto`` (a server's own choice) the
    dtype, and so the kernels, are not known here: named."""
    dtype = config.model_dtype(model)
    return dtype == "auto" or config.linears_for(model) != ("onednn" if dtype == "float32" else "torch")


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
                  store: RowStore, by_method: bool = False) -> list[tuple[EncodedPrompt, Method]]:
    """(prompt, method) pairs not yet in the store, prompt by prompt; the method order rotates by
    one each prompt so no method always runs first (or right after a given other one). With
    ``by_method`` (repeated workloads) each method runs the whole workload, passes in order, before
    the next method, so its later passes see the global store of its own earlier responses only."""
    if by_method:
        return [(prompt, method) for method in methods for prompt in workload
                if (prompt.id, method.spelling) not in store]
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
    last = None
    with tqdm(total=len(pending), desc=f"bench {Path(settings.dataset).stem}", unit="gen", dynamic_ncols=True) as bar:
        for prompt, method in pending:
            if settings.repeat > 1 and method != last:  # a method's passes start from an empty store
                runner.forget()
                last = method
            bar.set_postfix_str(f"{prompt.id} {method.spelling}", refresh=False)
            store.append(runner.run(method, prompt, settings.max_new_tokens, settings.sampling))
            bar.update()


def load_tokenizer(config: EngineConfig):
    """The target's tokenizer alone (no weights): enough to build and key the workload."""
    from transformers import AutoTokenizer

    from actors.loading import model_spec
    from engine.models import pretrained_args

    source, kwargs = pretrained_args(model_spec(config, config.target))
    return AutoTokenizer.from_pretrained(source, **kwargs)


def environment() -> dict:
    """The machine and library versions a run was measured with."""
    import torch
    import transformers

    return {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__}


def run_section(settings: BenchSettings, config: EngineConfig, methods: Sequence[Method], prompts: int) -> dict:
    """The results' ``settings``: what was run, on which config."""
    return {"config": settings.config, "dataset": settings.dataset, "num_prompts": prompts,
            "max_new_tokens": settings.max_new_tokens, "dtype": config.dtype, "sampling": asdict(settings.sampling),
            "via": settings.via, "label": settings.label, "concurrency": list(settings.concurrency),
            "methods": [m.spelling for m in methods],
            "proposers": list(Proposers.from_config(config).names), "expansion": config.speculation.expansion}


def run_pairs(settings: BenchSettings, config: EngineConfig, runner: Runner | None,
              pending: Sequence[tuple[EncodedPrompt, Method]], store: RowStore) -> None:
    """Run the pending pairs on ``runner``, or on a runner made (and closed) here when none is given."""
    created = bool(pending) and runner is None
    if created:
        runner = GrpcRunner(settings.via) if settings.via else LocalRunner(config, keep_responses=settings.repeat > 1)
    try:
        execute(runner, pending, settings, store)
    finally:
        if created:
            runner.close()


def run_bench(settings: BenchSettings, config: EngineConfig | None = None, runner: Runner | None = None) -> dict:
    """Run (or resume) a benchmark and write rows.jsonl, results.json, results.md and the plots."""
    config = config or load_config(settings.config, dtype=settings.dtype)
    if not settings.via:  # in-process: the models load here, and the run records the dtype measured
        from actors.loading import with_dtype_resolved

        config = with_dtype_resolved(config)
    methods = resolve_methods(settings.methods, config, settings.via)
    workload = load_workload(settings.dataset, load_tokenizer(config), settings.num_prompts, settings.max_prompt_tokens)
    workload = repeat_workload(workload, settings.repeat)
    settings.out.mkdir(parents=True, exist_ok=True)
    check_run_identity(settings.out / "run.json", run_identity(settings, config))
    store = RowStore(settings.out / "rows.jsonl")
    pending = [] if settings.load_only else pending_pairs(methods, workload, store, by_method=settings.repeat > 1)
    logger.info("%d of %d generations to run", len(pending), len(methods) * len(workload))
    run_pairs(settings, config, runner, pending, store)
    results = {"settings": run_section(settings, config, methods, len(workload)), "environment": environment(),
               "machine": machine(),
               **summarize(store.rows, methods, workload, Proposers.from_config(config).names)}
    if settings.repeat > 1:
        results["passes"] = pass_summary(results["per_prompt"], methods)
    if settings.concurrency:
        results["load"] = run_load(settings.load_plan(len(workload)), methods, workload, settings.out)
    write_outputs(settings.out, results)
    return results
