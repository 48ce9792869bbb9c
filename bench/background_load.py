"""The target's verify-cost curve with and without small background loads on the same cores.

    python bench/background_load.py --config configs/default.yaml --out bench/out/background_load.json

Why: served on a 2-core box, the verifier's forward costs about 1.3x the same forward in-process,
although a lone actor in an idle Ray costs what the driver does. Ray's and Serve's processes wake
about 2,000 times a second there (15-18% of one core); when the verifier's threads hold every core,
each wake-up stalls one of them and the other waits for it at the end of the parallel op. This
script reproduces that without Ray: it measures the in-process curve (``engine.budget``'s
``measure_target_curve``, the one the engines log) alone, then beside ``--processes`` busy loops
that each wake every PERIOD ms and spin BUSY ms (``--loads PERIOD:BUSY,...``), then alone again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from actors.targets import load_target
from cluster.build import set_threads
from engine.budget import measure_target_curve
from settings.config import load_config
from bench.machine import with_machine

# One background process: every period, spin for busy (both in seconds), until killed.
SPIN = """import sys, time
period, busy = float(sys.argv[1]), float(sys.argv[2])
while True:
    began = time.perf_counter()
    while time.perf_counter() - began < busy:
        pass
    time.sleep(period)
"""


def parse_loads(text: str) -> list[tuple[float, float]]:
    """'1:0.05,100:5' -> [(1.0, 0.05), (100.0, 5.0)]: (period ms, busy ms) per load level."""
    loads = []
    for item in filter(None, text.split(",")):
        try:
            period, busy = (float(part) for part in item.split(":"))
        except ValueError:
            period = busy = 0.0
        if not 0 < busy < period:
            raise ValueError(f"--loads {item!r}: PERIOD:BUSY in ms with 0 < BUSY < PERIOD")
        loads.append((period, busy))
    return loads


def curve_beside(target, max_tokens: int, processes: int, load: tuple[float, float] | None) -> dict[int, float]:
    """The curve while ``processes`` spin loops run ``load`` (None: alone); they are stopped after."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN, str(load[0] / 1e3), str(load[1] / 1e3)])
                for _ in range(processes if load else 0)]
    try:
        return measure_target_curve(target, max_tokens, float("inf"))
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--max-tokens", type=int, default=16, help="the curve's largest pass (powers of two up to it)")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--loads", default="1:0.05,10:0.5,100:5", help="PERIOD:BUSY in ms, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("bench/out/background_load.json"))
    args = parser.parse_args(argv)
    loads = parse_loads(args.loads)
    config = load_config(args.config)
    set_threads(config.torch_threads)
    target, _ = load_target(config)
    levels = [None, *loads, None]  # alone first and last: drift shows as the two differing
    runs = []
    for load in levels:
        curve = curve_beside(target, args.max_tokens, args.processes, load)
        period, busy = load or (None, None)
        share = 0.0 if load is None else args.processes * busy / (period + busy)  # cores the spinners use
        runs.append({"period_ms": period, "busy_ms": busy, "background_cores": round(share, 3), "curve_ms": curve})
        print(f"background {load or 'none'} x {args.processes if load else 0}: "
              f"{ {k: round(v, 1) for k, v in curve.items()} }", flush=True)
    result = with_machine({"config": args.config, "dtype": config.dtype, "torch_threads": config.torch_threads,
                           "processes": args.processes, "runs": runs})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
