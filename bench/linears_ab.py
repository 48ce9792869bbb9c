"""Two CPU linear-kernel settings (``cpu_linears``) end to end, in one process and alternating, so
that both see the same machine load: bf16 weights plain (``onednn``, torch's own path) against
packed once at load (``auto``, the default).

    python -m bench.linears_ab --config configs/default.yaml --dataset humaneval --num-prompts 10 \
        --methods incremental,tree,hf-assisted --out bench/out/linears-ab-humaneval.json

Builds one in-process engine per setting (each loads its own target and SSMs and measures its own
verify-cost curve), warms both up, then runs every method on every prompt on both engines, the
order of the two flipped from prompt to prompt. Reports per method the median over prompts of
ms / token on each and of the per-prompt ratio (A's ms / token over B's: above 1, B is faster),
tokens per step, and how many outputs match between the two (bf16 products summed in another
order may round differently, so greedy outputs can part after a while). Runs across processes on
this 2-core box differ by about 5% (neighbours, frequency), more than the difference measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from bench.machine import with_machine


def build_runners(config_path: str, settings: list[str], dtype: str | None):
    from settings.config import load_config

    from .runners import LocalRunner

    runners = {}
    for setting in settings:
        config = load_config(config_path, dtype=dtype, cpu_linears=setting)
        runners[setting] = LocalRunner(config)
        runners[setting].engine  # noqa: B018 (load now: both engines exist before any timing)
        print(f"{setting}: engine ready", flush=True)
    return runners, config


def run_pairs(runners: dict, methods, workload, max_new_tokens: int, warmup_tokens: int) -> list[dict]:
    from engine.sampling import SamplingParams

    greedy, names = SamplingParams(temperature=0.0), list(runners)
    for runner in runners.values():  # first calls pay one-off costs (allocator, oneDNN primitives)
        for method in methods:
            runner.run(method, workload[0], warmup_tokens, greedy)
    rows = []
    for index, prompt in enumerate(workload):
        for method in methods:
            order = names if index % 2 == 0 else names[::-1]
            got = {name: runners[name].run(method, prompt, max_new_tokens, greedy) for name in order}
            row = {"prompt_id": prompt.id, "method": method.spelling,
                   **{name: {"ms_per_token": round(r.ms_per_token, 2), "tokens_per_step": r.tokens_per_step,
                             "new_tokens": r.new_tokens} for name, r in got.items()},
                   "same_output": got[names[0]].token_ids == got[names[1]].token_ids}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def summarize(rows: list[dict], names: list[str]) -> dict:
    a, b = names
    summary = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        summary[method] = {
            "prompts": len(mine),
            **{f"{name}_ms_per_token": round(statistics.median(r[name]["ms_per_token"] for r in mine), 1)
               for name in names},
            **{f"{name}_tokens_per_step": round(statistics.median(r[name]["tokens_per_step"] or 1.0 for r in mine), 2)
               for name in names},
            "ratio_median": round(statistics.median(r[a]["ms_per_token"] / r[b]["ms_per_token"] for r in mine), 3),
            f"{b}_faster_prompts": sum(r[b]["ms_per_token"] < r[a]["ms_per_token"] for r in mine),
            "same_output": sum(r["same_output"] for r in mine),
        }
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--settings", default="onednn,auto", help="two cpu_linears values: A,B")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument("--methods", default="incremental,tree,hf-assisted")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.settings.split(",")]
    if len(names) != 2 or names[0] == names[1]:
        parser.error("--settings takes two different cpu_linears values, A,B")
    from .methods import resolve_methods
    from .workloads import load_workload

    runners, config = build_runners(args.config, names, args.dtype)
    methods = resolve_methods(args.methods.split(","), config)
    tokenizer = runners[names[0]].engine.tokenizer
    workload = load_workload(args.dataset, tokenizer, args.num_prompts)
    try:
        rows = run_pairs(runners, methods, workload, args.max_new_tokens, args.warmup_tokens)
    finally:
        for runner in runners.values():
            runner.close()
    summary = summarize(rows, names)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"config": args.config, "dataset": args.dataset, "settings": names,
                  "max_new_tokens": args.max_new_tokens, "rows": rows, "summary": summary}
        args.out.write_text(json.dumps(with_machine(result), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
