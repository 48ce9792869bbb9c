"""The int8 SSM's forward cost and memory by quantization path: torch.ao's ``quantize_dynamic``
(deprecated; what ``engine.models.quantize_int8`` uses, with its sibling projections fused) against
torchao's maintained API.

    python bench/experiments/int8_paths.py --model ~/.cache/specinfer/models/qwen2.5-coder-0.5b-instruct \
        --threads 2 --out bench/results/int8-paths.json

Each path runs in a fresh subprocess (its memory and compile caches apart), one after the other:
load the model in bf16 (as configured), quantize, prefill a ``--prefix``-token prompt, then time
one decode step (1 token) and one 4-token forward (a tree level), each the median of ``--repeats``
after warm-up, the cache cropped back after each. Also the process's RSS after quantizing (after
``malloc_trim``, as the actors do) and the peak.

Paths:
* ``fp32``: no quantization (the float copy every int8 path starts from).
* ``ao-dynamic``: ``torch.ao.quantization.quantize_dynamic`` (qint8 linears; fbgemm kernels).
* ``ao-dynamic-fused``: the same, then q/k/v and gate/up as one product each
  (``engine.fused_int8``): what the project runs.
* ``torchao-dyn``: torchao ``Int8DynamicActivationInt8WeightConfig``, eager.
* ``torchao-wo``: torchao ``Int8WeightOnlyConfig``, eager.
* ``torchao-dyn-compiled``: the ``torchao-dyn`` model under ``torch.compile`` (Inductor), compile
  time reported apart.

Needs ``pip install torchao`` (0.18 tried); a path that fails is reported with its error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from bench.machine import with_machine

PATHS = ("fp32", "ao-dynamic", "ao-dynamic-fused", "torchao-dyn", "torchao-wo", "torchao-dyn-compiled")


def quantize(model, path: str):
    import torch

    from engine.fused_int8 import fuse_int8_siblings

    model = model.float()
    if path.startswith("ao-dynamic"):
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
        if path == "ao-dynamic-fused":
            fuse_int8_siblings(model)
        return model
    if path.startswith("torchao"):
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig() if path == "torchao-wo" else Int8DynamicActivationInt8WeightConfig())
    return model


def time_forward(model, cache, tokens: int, repeats: int) -> float:
    """Median ms of a forward of ``tokens`` new tokens on ``cache`` (two warm-ups), the cache
    cropped back before each (timed with it: a view of each layer's entries, microseconds)."""
    import torch

    from engine import kv
    from engine.timing import median_ms

    length = kv.cache_length(cache)
    ids = torch.arange(100, 100 + tokens)[None]

    def forward() -> None:
        kv.crop(cache, length)
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    forward()
    milliseconds = median_ms(forward, repeats)
    kv.crop(cache, length)
    return milliseconds


def run_path(model_dir: str, path: str, threads: int, prefix: int, repeats: int) -> dict:
    """One path, in this process."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from actors.common import process_memory
    from engine.models import return_freed_memory

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    began = time.perf_counter()
    model = quantize(model, path)
    quantize_s = time.perf_counter() - began
    return_freed_memory()  # as the actors do after loading
    memory = process_memory()
    result = {"path": path, "quantize_s": round(quantize_s, 1), "VmRSS": memory["VmRSS"], "VmHWM": memory["VmHWM"]}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.arange(1000, 1000 + prefix)[None], past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        if path.endswith("compiled"):
            began = time.perf_counter()
            model.forward = torch.compile(model.forward)
            time_forward(model, cache, 1, 1)
            time_forward(model, cache, 4, 1)
            result["compile_s"] = round(time.perf_counter() - began, 1)
        result["decode_ms"] = round(time_forward(model, cache, 1, repeats), 1)
        result["level4_ms"] = round(time_forward(model, cache, 4, repeats), 1)
    result["VmHWM_end"] = process_memory()["VmHWM"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the SSM's directory (safetensors)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per path")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the subprocess: run this path
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    model = str(Path(args.model).expanduser())
    if args.one:
        print(json.dumps(run_path(model, args.one, args.threads, args.prefix, args.repeats)))
        return 0
    rows = []
    for path in args.paths.split(","):
        command = [sys.executable, __file__, "--model", model, "--threads", str(args.threads), "--prefix",
                   str(args.prefix), "--repeats", str(args.repeats), "--one", path]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            rows.append(json.loads(lines[-1]) if done.returncode == 0 and lines else
                        {"path": path, "error": done.stderr.strip().splitlines()[-1:]})
        except subprocess.TimeoutExpired:
            rows.append({"path": path, "error": f"timed out after {args.timeout:.0f} s"})
        print(json.dumps(rows[-1]), flush=True)
    print("| path | decode ms | 4-token level ms | RSS MB | peak RSS MB | quantize s | compile s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['path']} | failed: {r['error']} | | | | | |")
            continue
        print(f"| {r['path']} | {r['decode_ms']} | {r['level4_ms']} | {r['VmRSS']:.0f} | {r['VmHWM_end']:.0f} "
              f"| {r['quantize_s']} | {r.get('compile_s', '-')} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        result = {"threads": args.threads, "prefix": args.prefix, "rows": rows}
        Path(args.out).write_text(json.dumps(with_machine(result), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
