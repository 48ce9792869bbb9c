"""`specinfer experiment`: SSM subsets x expansion schedules x datasets, one table.

An experiment file (``configs/experiments/ensemble.yaml``) names a base engine config (or holds one
inline under ``engine:``), the SSMs to load (they replace the base config's), the subsets to try,
the schedules and the workloads. One engine holds every SSM; each (subset, schedule) is the bench
method ``tree[subset]:schedule`` and runs interleaved with ``incremental`` prompt by prompt, so the
per-dataset runs resume like ``specinfer bench`` (``OUT/<dataset>/rows.jsonl``).
Outputs: ``OUT/experiment.json`` and ``OUT/experiment.md``, plus each dataset's bench report.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from settings.config import Dtype, EngineConfig, ModelConfig, SuffixConfig, engine_section, read_yaml

from .report import experiment_markdown
from .run import BenchSettings, run_bench
from .runners import LocalRunner
from .workloads import DEFAULT_MAX_PROMPT_TOKENS


class ExperimentConfig(BaseModel):
    """An experiment file, validated. Exactly one of ``base_config`` and ``engine``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_config: str | None = None  # engine config path: relative to the working directory or to this file
    engine: dict | None = None  # or the engine config inline
    dtype: Dtype | None = None  # overrides the engine config's dtype
    ssms: list[ModelConfig] = Field(default_factory=list)
    suffix: SuffixConfig | None = SuffixConfig()
    subsets: list[list[str]] = Field(min_length=1)
    schedules: list[list[int]] = Field(min_length=1)
    datasets: list[str] = Field(default_factory=lambda: ["humaneval"], min_length=1)
    num_prompts: int = Field(default=20, ge=1)
    max_new_tokens: int = Field(default=128, ge=1)
    max_prompt_tokens: int = Field(default=DEFAULT_MAX_PROMPT_TOKENS, ge=1)
    warmup_tokens: int = Field(default=16, ge=0)
    out: str = "bench/out/experiment"

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


def load_experiment(path: str | Path) -> ExperimentConfig:
    return ExperimentConfig.model_validate(read_yaml(path))


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
    """The base engine config with the experiment's SSMs, suffix proposer and dtype."""
    if experiment.engine is not None:
        section = dict(experiment.engine)
    else:
        base = resolve_path(experiment.base_config, path.parent)
        section = dict(engine_section(read_yaml(base), base))
    section["ssms"] = [m.model_dump() for m in experiment.ssms]
    section["suffix"] = experiment.suffix.model_dump() if experiment.suffix else None
    if dtype or experiment.dtype:
        section["dtype"] = dtype or experiment.dtype
    return EngineConfig.model_validate(section)


@dataclass(frozen=True)
class ExperimentRow:
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


def experiment_rows(dataset: str, experiment: ExperimentConfig, summary: dict) -> list[ExperimentRow]:
    methods = experiment.methods()
    combos = [((), ())] + [(tuple(s), tuple(k)) for s in experiment.subsets for k in experiment.schedules]
    rows = []
    for method, (ssms, schedule) in zip(methods, combos):
        s = summary[method]
        rows.append(ExperimentRow(dataset, ssms, schedule, method, s["prompts"], s["tokens_per_step"],
                                  s["ms_per_token"], s["speedup_vs_incremental"], s["outputs_match_incremental"],
                                  s["mean_accepted_per_step"], s["proposer_share"]))
    return rows


def dataset_dir(dataset: str) -> str:
    """A directory name for a workload: its name, or a JSONL file's stem."""
    return dataset if dataset in ("humaneval", "sharegpt") else Path(dataset).stem


def run_experiment(path: str | Path, out: Path | None = None, dtype: str | None = None,
                   **overrides) -> list[ExperimentRow]:
    """Run (or resume) every dataset; ``overrides`` replace experiment fields (datasets, num_prompts, ...)."""
    path = Path(path)
    experiment = load_experiment(path)
    if overrides:
        experiment = ExperimentConfig.model_validate({**experiment.model_dump(), **overrides})
    config = engine_config(experiment, path, dtype)
    out = Path(out or experiment.out)
    runner = LocalRunner(config)  # one engine for every dataset
    rows: list[ExperimentRow] = []
    for dataset in experiment.datasets:
        settings = BenchSettings(config=str(path), dataset=dataset, out=out / dataset_dir(dataset),
                                 methods=tuple(experiment.methods()), num_prompts=experiment.num_prompts,
                                 max_new_tokens=experiment.max_new_tokens, dtype=config.dtype,
                                 max_prompt_tokens=experiment.max_prompt_tokens,
                                 warmup_tokens=experiment.warmup_tokens)
        results = run_bench(settings, config=config, runner=runner)
        rows += experiment_rows(dataset_dir(dataset), experiment, results["summary"])
    write_experiment(out, path, experiment, config, rows)
    return rows


def write_experiment(out: Path, path: Path, experiment: ExperimentConfig, config: EngineConfig,
                     rows: list[ExperimentRow]) -> None:
    data = {"experiment": str(path), "dtype": config.dtype, "target": config.target.name,
            "config": experiment.model_dump(mode="json"), "rows": [asdict(r) for r in rows]}
    (out / "experiment.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    title = f"{path.name}: target {config.target.name} ({config.dtype})"
    markdown = experiment_markdown([asdict(r) for r in rows], title, experiment.proposer_names())
    (out / "experiment.md").write_text(markdown, encoding="utf-8")
