"""Where a tree step's time goes on a GPU: host dispatch against device work, per phase and per op.

    python bench/gpu_step_profile.py --out $OUT/gpu_step_profile.json               # on a GPU machine
    python bench/gpu_step_profile.py --shape tiny --device cpu --out /tmp/s.json    # smoke test

The models of ``gpu_prefetch.py`` (the default pair's shapes, random bf16 weights, planted
next-token rules). Four views of the same tree decoding, one after another:

1. phases: every model forward and engine phase (extend, level forward, verify forward, commit...)
   timed with a device synchronisation after it, split into *host* ms (until the call returns:
   Python, dispatch, launches, blocking copies) and *drain* ms (the device work still queued then);
2. micro-timings: one SSM or target forward alone at the sizes a step uses, with the tree's float
   mask and without, and the host-side vocabulary work (copy, softmax, top-k) at the CPU's threads;
3. the torch profiler's op table (self CPU and device time), and how often the host waited;
4. cProfile's Python functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_common import IdTokenizer, synchronize  # noqa: E402
from bench.gpu_prefetch import (add_pair_arguments, buffer_slots, build_pair, graphed_engine, options,  # noqa: E402
                                random_prompts)
from engine import draft as draft_module  # noqa: E402
from engine import generate as generate_module  # noqa: E402
from engine import step as step_module  # noqa: E402
from engine.draft import ModelDrafter  # noqa: E402
from engine.generate import SpeculativeEngine  # noqa: E402
from engine.requests import GenerationRequest  # noqa: E402
from engine.target import TargetModel  # noqa: E402
from engine.tree import attention_bias  # noqa: E402
from bench.machine import with_machine  # noqa: E402


class Timings:
    """Per label: (host ms, drain ms) of every timed call."""

    def __init__(self, device: str):
        self.device, self.calls = device, defaultdict(list)

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            synchronize(self.device)
            began = time.perf_counter()
            result = original(*args, **kwargs)
            returned = time.perf_counter()
            synchronize(self.device)
            self.calls[label].append(((returned - began) * 1e3, (time.perf_counter() - returned) * 1e3))
            return result

        setattr(owner, name, timed)

    def table(self, steps: int) -> list[dict]:
        rows = []
        for label, calls in sorted(self.calls.items(), key=lambda kv: -sum(h + d for h, d in kv[1])):
            host, drain = [h for h, _ in calls], [d for _, d in calls]
            rows.append({"label": label, "calls": len(calls), "calls_per_step": len(calls) / steps,
                         "host_ms_median": statistics.median(host), "drain_ms_median": statistics.median(drain),
                         "ms_per_step": (sum(host) + sum(drain)) / steps})
        return rows


def timed_median(device: str, fn, repeats: int = 20) -> dict:
    """Median host and total ms of ``fn()`` over ``repeats`` calls after two warm-ups."""
    host, total = [], []
    for i in range(repeats + 2):
        synchronize(device)
        began = time.perf_counter()
        fn()
        returned = time.perf_counter()
        synchronize(device)
        if i >= 2:
            host.append((returned - began) * 1e3)
            total.append((time.perf_counter() - began) * 1e3)
    return {"host_ms": statistics.median(host), "total_ms": statistics.median(total)}


@torch.inference_mode()
def micro(model, device: str, dtype: torch.dtype, prefix: int, sizes: tuple[int, ...]) -> dict:
    """One forward of ``size`` tokens after a ``prefix``-token cache: with the tree's float mask
    (a chain: each sees the ones before, as a level or a tree pass) and plain causal."""
    from transformers import DynamicCache

    from engine import kv

    out = {}
    ids = torch.randint(0, model.config.vocab_size, (1, prefix), device=device)
    for size in sizes:
        for masked in (False, True):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, **kv.cache_argument(model, cache), use_cache=True, logits_to_keep=1)
            new = torch.randint(0, model.config.vocab_size, (1, size), device=device)
            extra = {}
            if masked:
                visible = torch.ones(size, size, dtype=torch.bool).tril()
                extra = {"attention_mask": attention_bias(visible, prefix, dtype).to(device),
                         "position_ids": torch.arange(prefix, prefix + size, device=device)[None]}

            def once():
                model(input_ids=new, **kv.cache_argument(model, cache), use_cache=True, **extra)
                kv.crop(cache, prefix)

            out[f"{size} tokens{' float mask' if masked else ''}"] = timed_median(device, once)
    return out


def vocabulary_work(device: str, vocab: int) -> dict:
    """The host-side work a level does per node on the vocabulary, at this CPU's thread count."""
    logits = torch.randn(2, vocab, device=device, dtype=torch.bfloat16)
    row = logits[0].float().cpu()
    result = {"threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "copy [2, V] to host": timed_median(device, lambda: logits.float().cpu()),
              "softmax [V] on host": timed_median("cpu", lambda: torch.softmax(row, -1)),
              "topk 2 of [V] on host": timed_median("cpu", lambda: torch.topk(row, 2))}
    result["topk 2 of [2, V] on device, to host"] = timed_median(
        device, lambda: torch.topk(torch.softmax(logits.float(), -1), 2).indices.cpu())
    return result


def op_table(engine, request, device: str) -> dict:
    """The torch profiler's view of one tree generation: top ops by self CPU and by device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        engine.generate(request)
    averages = prof.key_averages()
    by_cpu = averages.table(sort_by="self_cpu_time_total", row_limit=30)
    by_device = averages.table(sort_by="self_cuda_time_total", row_limit=15) if len(activities) > 1 else ""
    waits = {e.key: {"count": e.count, "cpu_ms": e.cpu_time_total / 1e3} for e in averages
             if any(w in e.key for w in ("Synchronize", "Memcpy", "_local_scalar_dense", "aten::item",
                                         "aten::to", "aten::copy_", "cudaLaunchKernel"))}
    return {"by_self_cpu": by_cpu, "by_device": by_device, "waits": waits}


def python_profile(engine, request) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    engine.generate(request)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(35)
    return text.getvalue()


def instrument(engine: SpeculativeEngine, device: str) -> Timings:
    timings = Timings(device)
    drafter, target = engine.drafters[0], engine.target
    timings.wrap(drafter.model, "forward", "ssm forward")
    timings.wrap(target.model, "forward", "target forward")
    for name in ("_extend", "_forward_level", "_put_levels_aside", "_resume"):
        timings.wrap(drafter, name, f"draft.{name}")
    for name in ("forward_tree", "commit"):
        timings.wrap(target, name, f"target.{name}")
    timings.wrap(draft_module.TreeBuilder, "build", "TreeBuilder.build")
    timings.wrap(step_module, "verify_greedy", "verify_greedy")
    timings.wrap(step_module, "step_outcome", "step_outcome")
    timings.wrap(step_module, "record_step", "record_step")
    timings.wrap(generate_module, "merge_drafts", "merge_drafts")
    timings.wrap(generate_module, "draft_with", "draft_with (whole draft)")
    timings.wrap(generate_module, "verify_and_commit", "verify_and_commit (whole verify)")
    return timings


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_pair_arguments(parser, tokens=64)
    parser.add_argument("--graphs", action="store_true", help="profile the engine over CUDA graphs (engine.graphs)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    pair = build_pair(args, 0)
    target, ssm, dtype = pair.target, pair.ssm, pair.dtype
    if args.graphs:
        engine = graphed_engine(target, ssm, buffer_slots(args.prompt_tokens, args.tokens))
    else:
        engine = SpeculativeEngine(TargetModel(target), [ModelDrafter(ssm, 0, "ssm")], IdTokenizer(), set())
    prompt = random_prompts(pair.vocab_size, 1, args.prompt_tokens, 3)[0]
    expansion = tuple(int(k) for k in args.expansion.split(","))
    request = GenerationRequest(tuple(prompt), args.tokens, speculation=options("tree", expansion, 0))
    plain = GenerationRequest(tuple(prompt), args.tokens, speculation=options("incremental", expansion, 0))
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "attention": getattr(target.config, "_attn_implementation", None)}
    for r in (plain, request, request):  # warm-up
        engine.generate(r)
    for name, r in (("incremental", plain), ("tree", request)):
        synchronize(args.device)
        began = time.perf_counter()
        out = engine.generate(r)
        synchronize(args.device)
        s = out.stats
        result[f"{name} run"] = {"ms": (time.perf_counter() - began) * 1e3, "steps": s.target_steps - 1,
                                 "draft_ms": s.draft_ms, "verify_ms": s.verify_ms, "tokens": s.new_tokens}
        print(name, result[f"{name} run"], flush=True)
    result["vocabulary"] = vocabulary_work(args.device, pair.vocab_size)
    if not args.graphs:
        result["ssm micro"] = micro(ssm, args.device, dtype, args.prompt_tokens, (1, 2))
        result["target micro"] = micro(target, args.device, dtype, args.prompt_tokens, (1, 15))
    print(json.dumps({k: result[k] for k in ("vocabulary", "ssm micro", "target micro") if k in result}, indent=1),
          flush=True)
    profiled = op_table(engine, request, args.device)
    result["ops"] = profiled
    print(profiled["by_self_cpu"], profiled["by_device"], json.dumps(profiled["waits"], indent=1), sep="\n", flush=True)
    result["python"] = python_profile(engine, request)
    print(result["python"], flush=True)
    timings = instrument(engine, args.device)
    out = engine.generate(request)
    result["phases"] = timings.table(max(1, out.stats.target_steps - 1))
    print("| phase | calls/step | host ms (median) | drain ms (median) | ms/step |\n|---|---:|---:|---:|---:|")
    for row in result["phases"]:
        print(f"| {row['label']} | {row['calls_per_step']:.1f} | {row['host_ms_median']:.2f} "
              f"| {row['drain_ms_median']:.2f} | {row['ms_per_step']:.1f} |")
    args.out.write_text(json.dumps(with_machine(result), indent=1))
    return result


if __name__ == "__main__":
    main()
