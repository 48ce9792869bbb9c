"""One plot and one table from several `specinfer bench --concurrency` runs (e.g. with and
without batching): aggregate tokens/s and ms/token p50 vs concurrency, one line per label and method.

    python bench/load_plot.py bench/results/load/batching bench/results/load/no-batching --out bench/results/load
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def levels(run: Path) -> list[dict]:
    load = json.loads((run / "results.json").read_text())["load"]
    return [{**level, "label": load["label"]} for level in load["levels"]]


def table(rows: list[dict]) -> str:
    lines = ["| label | method | C | agg tok/s | vs C=1 | ms/token p50 | ms/token p95 | TTFT ms p50 |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['label']} | `{r['method']}` | {r['concurrency']} | {r['aggregate_tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_concurrency_1']:.2f} | {r['ms_per_token_p50']:.0f} | {r['ms_per_token_p95']:.0f} | "
                     f"{r['ttft_ms_p50']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("bench/load_plot.py needs matplotlib: pip install 'specinfer[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r["label"], r["method"]) for r in rows}):
        series = sorted((r for r in rows if (r["label"], r["method"]) == key), key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in series]
        left.plot(x, [r["aggregate_tokens_per_s"] for r in series], marker="o", label=f"{key[1]}, {key[0]}")
        right.plot(x, [r["ms_per_token_p50"] for r in series], marker="o", label=f"{key[1]}, {key[0]}")
    for axis, title in ((left, "aggregate output tokens/s"), (right, "ms per token, p50")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    left.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [level for run in args.runs for level in levels(run)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.md").write_text(table(rows))
    plot(rows, args.out / "load.png")
    print(table(rows))


if __name__ == "__main__":
    main()
