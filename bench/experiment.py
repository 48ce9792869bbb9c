"""`specinfer experiment`: SSM subsets x expansion schedules x datasets x runs, one table.

An experiment file (``configs/experiments/ensemble.yaml``) names a base engine config (or holds one
inline under ``engine:``), the SSMs to load (they replace the base config's), the subsets to try,
the schedules, the workloads and the runs:

* ``in-process``: one engine holds every SSM and drafts a request's SSMs one after the other;
* ``served``: a Ray Serve app started here on loopback (the Serve config's proxies, the
  experiment's engine config), each SSM in its own actor, drafting concurrently, every request
  sent through gRPC. Each request gets its own forwards (continuous batching off, as in-process)
  and the suffix proposer's global store is off, so both runs see the same inputs: in-process the
  store is emptied before every generation.

Each (subset, schedule) is the bench method ``tree[subset]:schedule`` and runs interleaved with
``incremental`` prompt by prompt, so every (run, dataset) resumes like ``specinfer bench``
(``OUT/<run>/<dataset>/rows.jsonl``); a finished one loads no model. Outputs: ``OUT/experiment.json``
and ``OUT/experiment.md`` (the table, and each ensemble against its best member), ``OUT/ensembles.png``,
plus each run's bench report.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from settings.config import Dtype, EngineConfig, ModelConfig, SuffixConfig, engine_section, read_yaml

from .report import experiment_markdown, plot_ensembles
from .run import BenchSettings, run_bench
from .runners import LocalRunner, Runner, ServedRunner
from .workloads import DEFAULT_MAX_PROMPT_TOKENS
from .machine import with_machine


OBJECT_STORE_BYTES = 512 * 2**20  # the served run's Ray object store: requests and replies are small
Run = Literal["in-process", "served"]


class ExperimentConfig(BaseModel):
    """An experiment file, validated. Exactly one of ``base_config`` and ``engine``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_config: str | None = None  # engine config path: relative to the working directory or to this file
    engine: dict | None = None  # or the engine config inline
    dtype: Dtype | None = None  # overrides the engine config's dtype
    speculation: dict = Field(default_factory=dict)  # fields that replace the engine config's speculation ones
    ssms: list[ModelConfig] = Field(default_factory=list)
    suffix: SuffixConfig | None = SuffixConfig()
    subsets: list[list[str]] = Field(min_length=1)
    schedules: list[list[int]] = Field(min_length=1)
    datasets: list[str] = Field(default_factory=lambda: ["humaneval"], min_length=1)
    num_prompts: int = Field(default=20, ge=1)
    max_new_tokens: int = Field(default=128, ge=1)
    max_prompt_tokens: int = Field(default=DEFAULT_MAX_PROMPT_TOKENS, ge=1)
    warmup_tokens: int = Field(default=16, ge=0)
    runs: list[Run] = Field(default_factory=lambda: ["in-process"], min_length=1)
    serve_config: str = "configs/serve.yaml"  # the served run's proxies (its engine args are this experiment's)
    ready_timeout_s: float = Field(default=1800.0, gt=0)  # the served run waits this long for its app
    out: str = "bench/out/experiment"

    @field_validator("runs")
    @classmethod
    def _runs(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"runs listed twice: {value}")
        return value

    @field_validator("schedules")
    @classmethod
    def _schedules(cls, value: list[list[int]]) -> list[list[int]]:
        if any(not s or len(s) > 32 or any(not 1 <= k <= 64 for k in s) for s in value):
            raise ValueError("each schedule needs 1..32 widths, each in [1, 64]")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "ExperimentConfig":
        if (self.base_config is None) == (self.engine is None):
            raise ValueError("give exactly one of base_config (a path) and engine (an inline engine config)")
        names = self.proposer_names()
        if len(set(names)) != len(names):
            raise ValueError(f"SSM names must be unique, got {names}")
        for subset in self.subsets:
            unknown = sorted(set(subset) - set(names))
            if not subset or unknown or len(set(subset)) != len(subset):
                raise ValueError(f"subset {subset}: needs distinct known names (unknown: {unknown}); known: {names}")
        return self

    def proposer_names(self) -> list[str]:
        return [m.name for m in self.ssms] + ([self.suffix.name] if self.suffix else [])

    def methods(self) -> list[str]:
        """``incremental`` then ``tree[subset]:schedule`` for every subset and schedule."""
        return ["incremental"] + [f"tree[{','.join(subset)}]:{'-'.join(map(str, schedule))}"
                                  for subset in self.subsets for schedule in self.schedules]


def load_experiment(path: str | Path, **overrides) -> ExperimentConfig:
    """An experiment file, validated with ``overrides`` replacing its fields (datasets, runs, ...)."""
    return ExperimentConfig.model_validate({**read_yaml(path), **overrides})


def resolve_path(value: str, relative_to: Path) -> Path:
    """A path as given if it exists from the working directory, else relative to ``relative_to``
    or one of its parents (so ``configs/default.yaml`` works from anywhere in the repository)."""
    given = Path(value).expanduser()
    if given.is_absolute() or given.exists():
        return given
    for folder in (relative_to, *relative_to.resolve().parents):
        if (folder / given).exists():
            return folder / given
    raise FileNotFoundError(f"{value} not found from the working directory, {relative_to} or its parents")


def engine_config(experiment: ExperimentConfig, path: Path, dtype: str | None = None) -> EngineConfig:
    """The base engine config with the experiment's SSMs, suffix proposer, speculation and dtype."""
    if experiment.engine is not None:
        section = dict(experiment.engine)
    else:
        base = resolve_path(experiment.base_config, path.parent)
        section = dict(engine_section(read_yaml(base), base))
    section["ssms"] = [m.model_dump() for m in experiment.ssms]
    section["suffix"] = experiment.suffix.model_dump() if experiment.suffix else None
    section["speculation"] = {**(section.get("speculation") or {}), **experiment.speculation}
    if dtype or experiment.dtype:
        section["dtype"] = dtype or experiment.dtype
    return EngineConfig.model_validate(section)


def served_args(config: EngineConfig) -> dict:
    """The served run's app args: the engine config with continuous batching off (each request gets
    its own forwards and follows its schedule as given, as in-process) and the suffix proposer's
    global store off (each request sees its own tokens only, as in-process: ``LocalRunner`` empties
    the store before every generation, and a server's store cannot be emptied from outside)."""
    args = config.model_dump(mode="json")
    args["server"]["batching"]["enabled"] = False
    if args.get("suffix"):
        args["suffix"]["max_cached_requests"] = 0
    return args


@dataclass(frozen=True)
class ExperimentRow:
    run: str  # "in-process" | "served"
    dataset: str
    ssms: tuple[str, ...]  # () for the incremental baseline
    schedule: tuple[int, ...]
    method: str
    prompts: int
    tokens_per_step: float | None
    ms_per_token: float | None
    speedup_vs_incremental: float | None
    outputs_match_incremental: float | None
    mean_accepted_per_step: float | None
    proposer_share: dict[str, float] | None
    nodes_per_step: float | None  # drafted tree nodes per verify step
    draft_ms_per_step: float | None  # drafting (SSMs, merge, transport) per verify step
    verify_ms_per_step: float | None


def experiment_rows(run: str, dataset: str, experiment: ExperimentConfig, summary: dict) -> list[ExperimentRow]:
    methods = experiment.methods()
    combos = [((), ())] + [(tuple(s), tuple(k)) for s in experiment.subsets for k in experiment.schedules]
    rows = []
    for method, (ssms, schedule) in zip(methods, combos):
        s = summary[method]
        rows.append(ExperimentRow(run, dataset, ssms, schedule, method, s["prompts"], s["tokens_per_step"],
                                  s["ms_per_token"], s["speedup_vs_incremental"], s["outputs_match_incremental"],
                                  s["mean_accepted_per_step"], s["proposer_share"], s["nodes_per_step"],
                                  s["draft_ms_per_step"], s["verify_ms_per_step"]))
    return rows


@dataclass(frozen=True)
class EnsembleVerdict:
    """A merged ensemble (a subset of two or more proposers) against its best member: the member
    with the highest median speedup run alone, same run, dataset and schedule."""

    ensemble: ExperimentRow
    member: ExperimentRow

    @property
    def beats(self) -> bool:
        return self.ensemble.speedup_vs_incremental > self.member.speedup_vs_incremental


def ensemble_verdicts(rows: Sequence[ExperimentRow]) -> list[EnsembleVerdict]:
    """Every ensemble row whose members all ran alone, against the fastest of them.

    Example: with rows for {a} (speedup 1.5), {b} (1.1) and {a, b} (1.4) on one run, dataset and
    schedule -> one verdict: {a, b} against a, 1.4 vs 1.5 (does not beat it).
    """
    alone = {(r.run, r.dataset, r.schedule, r.ssms[0]): r for r in rows
             if len(r.ssms) == 1 and r.speedup_vs_incremental is not None}
    verdicts = []
    for r in rows:
        members = [alone.get((r.run, r.dataset, r.schedule, name)) for name in r.ssms]
        if len(r.ssms) >= 2 and r.speedup_vs_incremental is not None and None not in members:
            verdicts.append(EnsembleVerdict(r, max(members, key=lambda m: m.speedup_vs_incremental)))
    return verdicts


def dataset_dir(dataset: str) -> str:
    """A directory name for a workload: its name, or a JSONL file's stem."""
    return dataset if dataset in ("humaneval", "sharegpt") else Path(dataset).stem


def make_runner(run: str, experiment: ExperimentConfig, config: EngineConfig, path: Path) -> Runner:
    """The run's runner; neither loads a model or starts a server before its first generation."""
    if run == "in-process":
        return LocalRunner(config)
    from cluster.k8s import cpus_per_pipeline

    serve_config = resolve_path(experiment.serve_config, path.parent)
    cpus = max(os.cpu_count() or 1, math.ceil(cpus_per_pipeline(config)))  # every actor placed, even on 2 cores
    return ServedRunner(str(serve_config), served_args(config), experiment.ready_timeout_s, num_cpus=cpus,
                        object_store_memory=OBJECT_STORE_BYTES)


def run_experiment(path: str | Path, experiment: ExperimentConfig | None = None, out: Path | None = None,
                   dtype: str | None = None) -> list[ExperimentRow]:
    """Run (or resume) every run and dataset of ``experiment`` (default: the file at ``path``, whose
    folder resolves its relative paths)."""
    path = Path(path)
    experiment = experiment or load_experiment(path)
    from actors.loading import with_dtype_resolved

    config = with_dtype_resolved(engine_config(experiment, path, dtype))  # recorded: the dtype measured
    out = Path(out or experiment.out)
    rows: list[ExperimentRow] = []
    generation_ms = 0.0
    for run in experiment.runs:
        runner = make_runner(run, experiment, config, path)  # one engine (or server) per run
        try:
            for dataset in experiment.datasets:
                results = run_bench(run_settings(experiment, path, config, run, dataset, out), config, runner)
                rows += experiment_rows(run, dataset_dir(dataset), experiment, results["summary"])
                generation_ms += sum(r["latency_ms"] for r in results["per_prompt"])
        finally:
            runner.close()  # frees the in-process engine's memory before the served run loads its own
    write_experiment(out, path, experiment, config, rows, generation_ms / 3.6e6)
    return rows


def run_settings(experiment: ExperimentConfig, path: Path, config: EngineConfig, run: str, dataset: str,
                 out: Path) -> BenchSettings:
    return BenchSettings(config=str(path), dataset=dataset, out=out / run / dataset_dir(dataset),
                         methods=tuple(experiment.methods()), num_prompts=experiment.num_prompts,
                         max_new_tokens=experiment.max_new_tokens, dtype=config.dtype,
                         max_prompt_tokens=experiment.max_prompt_tokens, warmup_tokens=experiment.warmup_tokens,
                         label=None if run == "in-process" else "served: Ray Serve + gRPC, one actor per SSM")


def write_experiment(out: Path, path: Path, experiment: ExperimentConfig, config: EngineConfig,
                     rows: list[ExperimentRow], generation_hours: float) -> None:
    verdicts = ensemble_verdicts(rows)
    data = {"experiment": str(path), "dtype": config.dtype, "target": config.target.name,
            "config": experiment.model_dump(mode="json"), "generation_hours": generation_hours,
            "rows": [asdict(r) for r in rows],
            "ensembles": [{**asdict(v), "beats_best_member": v.beats} for v in verdicts]}  # rows: ensemble, member
    (out / "experiment.json").write_text(json.dumps(with_machine(data), indent=1) + "\n", encoding="utf-8")
    title = f"{path.name}: target {config.target.name} ({config.dtype})"
    markdown = experiment_markdown([asdict(r) for r in rows], title, experiment.proposer_names(),
                                   data["ensembles"], generation_hours)
    (out / "experiment.md").write_text(markdown, encoding="utf-8")
    plot_ensembles(out / "ensembles.png", data["ensembles"])
