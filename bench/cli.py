"""`specinfer bench` and `specinfer experiment`: their argument parsers and command functions.

``cluster/cli.py`` registers them by importing this module when it builds the parser."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from .method_names import GREEDY_METHODS, SAMPLED_METHODS, SPELLINGS

if TYPE_CHECKING:  # the harness (torch, transformers) is imported by the commands, not by `--help`
    from .run import BenchSettings

DTYPES = ["auto", "float32", "bfloat16", "float16"]  # settings.config.Dtype (auto: bf16 where native, else float32)


def add_parsers(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="compare decoding methods on a workload (resumable)",
        description="Run decoding methods interleaved prompt by prompt in one process; write OUT/rows.jsonl "
                    "(resumable), OUT/results.json, OUT/results.md and PNG plots.")
    bench.add_argument("--config", required=True, help="engine config or Serve config (YAML)")
    bench.add_argument("--dataset", default="humaneval", help="humaneval, sharegpt, or a .jsonl file with a 'prompt' "
                                                              "field and an optional 'id' (default: humaneval)")
    bench.add_argument("--num-prompts", type=int, default=20)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--methods", default=None,
                       help=f"comma-separated: {SPELLINGS}. Default: {','.join(GREEDY_METHODS)}; with "
                            f"--temperature > 0: {','.join(SAMPLED_METHODS)}")
    bench.add_argument("--out", type=Path, required=True, help="output directory (rerun to resume)")
    bench.add_argument("--dtype", choices=DTYPES, default=None, help="override the config's dtype")
    bench.add_argument("--via", nargs=2, metavar=("grpc", "ADDRESS"), default=None,
                       help="run against a running server (e.g. --via grpc 127.0.0.1:9000)")
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    bench.add_argument("--top-p", type=float, default=1.0)
    bench.add_argument("--top-k", type=int, default=0)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer prompts (default 1024)")
    bench.add_argument("--warmup-tokens", type=int, default=16,
                       help="tokens of the one unrecorded warm-up generation per method (0: none)")
    bench.add_argument("--repeat", type=int, default=1,
                       help="ask the prompts this many times, pass after pass, one method after the other (a "
                            "repeated-prompt workload: what "
                            "the suffix proposer's global store adds); results.md compares the passes")
    bench.add_argument("--label", default=None,
                       help="a name stored with the results and shown in results.md (e.g. the server-side "
                            "setting under test: --label batching, --label no-batching)")
    load = bench.add_argument_group("load test (needs --via grpc ADDRESS)")
    load.add_argument("--concurrency", type=concurrency_levels, default=(), metavar="C1,C2,...",
                      help="after the per-prompt comparison, keep C client streams busy per level and method "
                           "(e.g. 1,2,4,8); adds a load table, load.png and results.json 'load'")
    load.add_argument("--load-only", action="store_true",
                      help="skip the per-prompt comparison: run only the concurrency levels")
    load.add_argument("--requests", type=int, default=None,
                      help="requests per concurrency level (prompts cycled; default: max(prompts, largest C))")
    bench.set_defaults(handler=run_bench_command, bench_parser=bench)

    experiment = subparsers.add_parser(
        "experiment", help="SSM subsets x schedules x datasets x runs (configs/experiments/*.yaml)",
        description="Run an experiment file: every SSM subset with every expansion schedule on every dataset, "
                    "against incremental decoding, in-process and/or served (a Ray Serve app started here, one "
                    "actor per SSM); write OUT/experiment.md, OUT/experiment.json and OUT/ensembles.png. "
                    "Resumable: rerun the same command.")
    experiment.add_argument("--config", required=True, help="experiment file (YAML)")
    experiment.add_argument("--out", type=Path, default=None, help="default: the file's 'out'")
    experiment.add_argument("--dtype", choices=DTYPES, default=None)
    experiment.add_argument("--datasets", default=None, help="comma-separated; overrides the file's datasets")
    experiment.add_argument("--num-prompts", type=int, default=None)
    experiment.add_argument("--max-new-tokens", type=int, default=None)
    experiment.add_argument("--runs", default=None,
                            help="comma-separated, of in-process and served; overrides the file's runs")
    experiment.set_defaults(handler=run_experiment_command, experiment_parser=experiment)


def concurrency_levels(text: str) -> tuple[int, ...]:
    """``1,2,4,8`` -> (1, 2, 4, 8); argparse reports anything else."""
    try:
        levels = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,4,8, got {text!r}") from None
    if any(level < 1 for level in levels) or len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(f"levels must be distinct integers >= 1, got {text!r}")
    return levels


def bench_settings(args: argparse.Namespace) -> BenchSettings:
    from engine.sampling import SamplingParams

    from .run import BenchSettings

    if args.via and args.via[0] != "grpc":
        raise ValueError(f"--via takes 'grpc ADDRESS', got {' '.join(args.via)!r}")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    default = GREEDY_METHODS if sampling.greedy else SAMPLED_METHODS
    methods = tuple(args.methods.split(",")) if args.methods else default
    return BenchSettings(config=args.config, dataset=args.dataset, out=args.out, methods=methods,
                         num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                         sampling=sampling, via=args.via[1] if args.via else None,
                         max_prompt_tokens=args.max_prompt_tokens, warmup_tokens=args.warmup_tokens,
                         concurrency=args.concurrency, requests=args.requests, label=args.label,
                         load_only=args.load_only, repeat=args.repeat)


def run_bench_command(args: argparse.Namespace) -> int:
    from .run import run_bench

    try:
        settings = bench_settings(args)
    except ValueError as error:  # BenchSettings checks the options: an argparse error, exit code 2
        args.bench_parser.error(str(error))
    run_bench(settings)
    print((settings.out / "results.md").read_text(encoding="utf-8"))
    load = ", load.jsonl" if settings.concurrency else ""
    print(f"wrote {settings.out}/results.json, results.md, rows.jsonl{load} and plots")
    return 0


def run_experiment_command(args: argparse.Namespace) -> int:
    from .experiment import load_experiment, run_experiment

    overrides = {k: v for k, v in (("num_prompts", args.num_prompts), ("max_new_tokens", args.max_new_tokens),
                                   ("datasets", args.datasets.split(",") if args.datasets else None),
                                   ("runs", args.runs.split(",") if args.runs else None)) if v is not None}
    try:  # a bad file or override is a usage error (exit code 2) naming the field
        experiment = load_experiment(args.config, **overrides)
    except (OSError, ValueError) as error:
        args.experiment_parser.error(str(error))
    out = args.out or Path(experiment.out)
    run_experiment(args.config, experiment, out=out, dtype=args.dtype)
    print((out / "experiment.md").read_text(encoding="utf-8"))
    print(f"wrote {out}/experiment.json and experiment.md")
    return 0
