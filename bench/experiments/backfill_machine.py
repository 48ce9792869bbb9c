"""One-off: add a ``machine`` record to result files written before ``bench.machine`` existed.

Which machine made a file comes from BENCHMARKS.md's dated sections (their headings and notes
name the box); a file no section places is marked ``{"recorded": "unknown"}``. Run once from the
repository root: ``python -m bench.experiments.backfill_machine``; files that already carry a
record are left alone.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path("bench/results")
BACKFILLED = "backfilled from BENCHMARKS.md"
NO_AMX = {"amx_bf16": False, "amx_tile": False}
MACHINES = {
    "avx512-bf16-epyc": {"cpu_model": "AMD EPYC (2 cores, model string not recorded)",
                         "isa": {"avx2": True, "avx512f": True, "avx512_bf16": True, **NO_AMX}, "gpu": None},
    "avx2-epyc": {"cpu_model": "AMD EPYC (2 cores, model string not recorded)",
                  "isa": {"avx2": True, "avx512f": False, "avx512_bf16": False, **NO_AMX}, "gpu": None},
    "amx-xeon": {"cpu_model": "Intel Xeon (2 cores, model string not recorded)",
                 "isa": {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": True, "amx_tile": True},
                 "gpu": None},
    "h200": {"cpu_model": None, "isa": None, "gpu": "NVIDIA H200"},
}
# Path prefixes under bench/results -> the machine BENCHMARKS.md names for them (first match wins).
PLACES = [
    ("bf16-amx/", "amx-xeon"), ("packed-bf16-amx/", "amx-xeon"), ("experiment-ensemble-bf16-packed/", "amx-xeon"),
    ("gpu-h200/", "h200"),
    ("cpu-linears-", "avx2-epyc"), ("fused-int8-fp32-avx2/", "avx2-epyc"), ("int8-fused-ab.json", "avx2-epyc"),
    ("load-goodput-", "avx2-epyc"), ("humaneval-fp32-cost-", "avx2-epyc"), ("memory/", "avx2-epyc"),
    ("int8-paths.json", "avx2-epyc"), ("humaneval-repeat-fp32/", "avx2-epyc"), ("offload-disk-bf16/", "avx2-epyc"),
    ("prefetch-bf16/", "avx2-epyc"), ("experiment-ensemble-fp32/", "avx2-epyc"),
    ("humaneval-bf16/", "avx512-bf16-epyc"), ("sharegpt-bf16/", "avx512-bf16-epyc"),
    ("served-overhead", "avx512-bf16-epyc"), ("headline-", "avx512-bf16-epyc"),
    ("experiment-small/", "avx512-bf16-epyc"), ("load/", "avx512-bf16-epyc"),
    ("cost-curve-bf16-avx512.json", "avx512-bf16-epyc"), ("humaneval-bf16-", "avx512-bf16-epyc"),
    ("sharegpt-bf16-", "avx512-bf16-epyc"), ("load-bf16-", "avx512-bf16-epyc"),
    ("experiment-ensemble-bf16/", "avx512-bf16-epyc"), ("humaneval-repeat-bf16", "avx512-bf16-epyc"),
    ("load-ttft-sjf/", "avx512-bf16-epyc"), ("load-burst/", "avx512-bf16-epyc"),
]


def place(relative: str) -> str | None:
    """The machine key of a path relative to bench/results, or None where no section names one."""
    return next((key for prefix, key in PLACES if relative.startswith(prefix)), None)


def record(relative: str, data: dict) -> dict:
    """The backfilled record: the named machine, torch threads where the file kept them, no commit."""
    key = place(relative)
    if key is None:
        return {"recorded": "unknown"}
    threads = data.get("environment", {}).get("torch_threads", data.get("threads"))
    return {"recorded": BACKFILLED, "name": key, **MACHINES[key], "torch_threads": threads, "commit": None}


def backfill(root: Path = RESULTS) -> int:
    """Add ``machine`` to every result JSON under ``root`` that lacks it; the number of files changed."""
    changed = 0
    for path in sorted(root.rglob("*.json")):
        if path.name == "run.json":  # a run's identity, compared on resume: not a result
            continue
        text = path.read_text()
        data = json.loads(text)
        if "machine" in data:
            continue
        indent = 2 if text.startswith("{\n  ") else 1
        data["machine"] = record(path.relative_to(root).as_posix(), data)
        path.write_text(json.dumps(data, indent=indent) + ("\n" if text.endswith("\n") else ""))
        changed += 1
    return changed


if __name__ == "__main__":
    print(f"{backfill()} files given a machine record")
