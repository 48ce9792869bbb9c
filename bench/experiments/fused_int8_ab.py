"""The int8 SSM's forward with and without fused sibling projections (``engine.fused_int8``), in
one process and alternating, so that both see the same machine load.

    python bench/experiments/fused_int8_ab.py --model ~/.cache/specinfer/models/qwen2.5-coder-0.5b-instruct \
        --threads 2 --rounds 8 --out bench/results/int8-fused-ab.json

Loads the model in bf16 (as configured), makes two int8 copies (``bench.experiments.int8_paths``' paths
``ao-dynamic``, ``quantize_dynamic`` alone, and ``ao-dynamic-fused``, then fused as
``engine.models.quantize_int8`` does), checks that their logits over the prompt are equal,
then per round times a decode step (1 token) and a tree level (4 tokens) on each, each the median
of ``--repeats`` (``bench.experiments.int8_paths.time_forward``). Reports each round and the median over rounds.
``bench/experiments/int8_paths.py`` runs each path in a fresh process instead (its memory apart), where this
box's noise between processes is larger than the difference.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

from bench.experiments.int8_paths import quantize, time_forward
from bench.machine import with_machine

VARIANTS = {"separate": "ao-dynamic", "fused": "ao-dynamic-fused"}  # bench.experiments.int8_paths' paths


def load_variants(model_dir: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    variants = {}
    for name, path in VARIANTS.items():
        began = time.perf_counter()
        variants[name] = quantize(copy.deepcopy(model), path)
        print(f"{path}: quantized in {time.perf_counter() - began:.1f} s", flush=True)
    return variants


def main(argv=None) -> int:
    import torch
    from transformers import DynamicCache

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the SSM's directory (safetensors)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = load_variants(str(Path(args.model).expanduser()))
    prompt = torch.arange(1000, 1000 + args.prefix)[None]
    caches, logits = {}, {}
    with torch.inference_mode():
        for name, model in models.items():
            caches[name] = DynamicCache(config=model.config)
            logits[name] = model(input_ids=prompt, past_key_values=caches[name], use_cache=True).logits
        equal = torch.equal(logits["separate"], logits["fused"])
        print(f"logits over the {args.prefix}-token prompt equal: {equal}", flush=True)
        rounds = []
        for index in range(args.rounds):
            row = {name: {"decode_ms": round(time_forward(models[name], caches[name], 1, args.repeats), 1),
                          "level4_ms": round(time_forward(models[name], caches[name], 4, args.repeats), 1)}
                   for name in VARIANTS}
            rounds.append(row)
            print(json.dumps({"round": index, **row}), flush=True)
    summary = {name: {key: round(statistics.median(r[name][key] for r in rounds), 1)
                      for key in ("decode_ms", "level4_ms")} for name in VARIANTS}
    faster = {key: sum(r["fused"][key] < r["separate"][key] for r in rounds) for key in ("decode_ms", "level4_ms")}
    print("| variant | decode ms (median of rounds) | 4-token level ms |\n|---|---:|---:|")
    for name in VARIANTS:
        print(f"| {name} | {summary[name]['decode_ms']} | {summary[name]['level4_ms']} |")
    print(f"fused faster in {faster['decode_ms']} / {faster['level4_ms']} of {args.rounds} rounds (decode / level)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        result = {"threads": args.threads, "prefix": args.prefix, "repeats": args.repeats, "logits_equal": equal,
                  "rounds": rounds, "median": summary, "fused_faster_rounds": faster}
        Path(args.out).write_text(json.dumps(with_machine(result), indent=1) + "\n")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
