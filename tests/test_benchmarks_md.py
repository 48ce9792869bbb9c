"""BENCHMARKS.md is the generator's output from the committed result files, never typed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import benchmarks_md as md

ROOT = Path(__file__).resolve().parents[1]


def test_committed_benchmarks_md_is_the_generators_output():
    expected = md.render(md.TEMPLATE.read_text())
    assert (ROOT / "BENCHMARKS.md").read_text() == expected, "run: python -m bench.benchmarks_md"
    assert len(expected.splitlines()) < 400


def test_every_cited_file_is_committed_and_names_its_machine():
    cited = md.cited_files(md.TEMPLATE.read_text())
    assert {f"{run}/results.json" for run in md.HEADLINE_RUNS} <= cited
    for file in cited:
        assert md.load(file)["machine"]["recorded"] in {"at run time", "backfilled from BENCHMARKS.md"}, file


def test_bench_results_holds_only_what_benchmarks_md_cites():
    cited = md.cited_files(md.TEMPLATE.read_text())
    committed = {p.relative_to(ROOT / md.RESULTS).as_posix() for p in (ROOT / md.RESULTS).rglob("*.json")
                 if p.name != "run.json"}
    assert committed == cited, "cite a result file from bench/benchmarks_template.md, or leave it in bench/out"


def test_every_result_file_carries_a_machine_record():
    for path in (ROOT / md.RESULTS).rglob("*.json"):
        if path.name != "run.json":
            assert "recorded" in json.loads(path.read_text())["machine"], path


def row(prompt, method, ms):
    return {"prompt_id": prompt, "method": method, "ms_per_token": ms}


def test_ratio_is_the_median_of_per_prompt_ratios_on_prompts_both_ran():
    rows = [row("a", "base", 100), row("a", "m", 50), row("b", "base", 90), row("b", "m", 90),
            row("c", "base", 300), row("c", "m", 100), row("d", "m", 1)]  # d: no baseline, left out
    assert md.per_prompt_ratio(rows, "m", "base") == 2.0  # median of 2.0, 1.0, 3.0; not 490 / 240
    assert md.per_prompt_ratio(rows, "m", "absent") is None
    latency = [{"prompt_id": "a", "method": "m", "latency_ms": 400, "new_tokens": 4}, row("a", "base", 200)]
    assert md.per_prompt_ratio(latency, "m", "base") == 2.0  # rows without ms_per_token: latency / tokens


def test_lookup_walks_keys_indices_and_selections():
    data = {"levels": [{"method": "tree", "c": 1, "x": 1}, {"method": "tree", "c": 8, "x": 2},
                       {"method": "incremental", "c": 8, "x": 3}]}
    assert md.lookup(data, "levels>method=tree&c=8>x") == 2
    assert md.lookup(data, "levels>2>method") == "incremental"


def test_unknown_placeholder_is_refused():
    with pytest.raises(ValueError, match="unknown placeholder"):
        md.render("{{nothing here}}")
    with pytest.raises(KeyError):
        md.render("{{table no_such_table | x.json}}")


def test_headline_keeps_the_newest_run_per_workload_machine_and_method():
    chosen = dict(md.headline_rows())
    for run in md.HEADLINE_RUNS:
        data = md.load(f"{run}/results.json")
        key = (md.workload_name(data["settings"]), md.machine_name(data["machine"]))
        for method in set(data["summary"]) & set(md.METHOD_ORDER):
            newest = md.load(chosen[(*key, method)])["environment"]["time"]
            assert newest >= data["environment"]["time"], (run, method)


def test_machine_names_from_records():
    amx = {"recorded": "at run time", "cpu_model": "Xeon X", "gpu": None,
           "isa": {"avx2": True, "avx512_bf16": True, "amx_bf16": True}}
    assert md.machine_name(amx) == "AMX Xeon X"
    assert md.machine_name({**amx, "isa": {"avx2": True}, "cpu_model": "EPYC"}) == "AVX2 EPYC"
    assert md.machine_name({**amx, "isa_cap": "ONEDNN_MAX_CPU_ISA=AVX2"}) == \
        "AMX Xeon X capped by ONEDNN_MAX_CPU_ISA=AVX2"
    assert md.machine_name({**amx, "gpu": "NVIDIA H100"}) == "NVIDIA H100"
    assert md.machine_name({"recorded": "backfilled from BENCHMARKS.md", "name": "h200"}) == "H200"
    assert md.machine_name({"recorded": "unknown"}) == md.machine_name(None) == "unknown"
