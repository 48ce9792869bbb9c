"""Offloading on one GPU (host tier): a target shaped like the default one (Qwen2.5-1.5B), random
bf16 weights, every decoder layer copied from pinned host memory for every pass.

    python bench/gpu_offload.py --out $OUT/gpu_offload.json                       # on a GPU machine
    python bench/gpu_offload.py --shape tiny --device cpu --out /tmp/o.json      # smoke test

Needs torch and transformers only (no Ray, no network): the random target is written once as
safetensors under ``--work`` (3.1 GB for the default shape) and loaded by ``engine.offload`` with
``resident_layers`` capped (0 by default), so the model does not fit on the device. Prints:

* the pass-cost curve of the streamed target (tokens per pass -> ms), next to the resident one's;
* incremental, sequence:4 and tree (4-2-2-1-1-1-1-1) decoding with an SSM made of the target's
  first ``--ssm-layers`` layers (resident): ms per token, tokens per pass, MB copied per token,
  peak host RSS and peak GPU memory. Random weights make acceptance unrepresentative of real
  models; the curve and the per-pass costs are the figures that carry over.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_common import IdTokenizer, synchronize  # noqa: E402
from engine.budget import time_tree_pass  # noqa: E402
from engine.draft import ModelDrafter  # noqa: E402
from engine.generate import SpeculativeEngine  # noqa: E402
from engine.models import ModelSpec, truncate_layers  # noqa: E402
from engine.offload import OffloadSpec, load_offloaded, streamer_of  # noqa: E402
from engine.requests import GenerationRequest, SpeculationOptions  # noqa: E402
from engine.target import TargetModel  # noqa: E402
from bench.machine import with_machine  # noqa: E402

SHAPES = {  # Qwen2.5-Coder-1.5B's shape; "tiny" for a CPU smoke test
    "qwen2.5-1.5b": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096},
}
METHODS = {"incremental": ("incremental", (1,)), "sequence:4": ("sequence", (1,)),
           "tree": ("tree", (4, 2, 2, 1, 1, 1, 1, 1))}


class NoTokenizer:
    @staticmethod
    def from_pretrained(*args, **kwargs):
        return IdTokenizer()


def write_model(shape: str, directory: Path) -> None:
    """A random Qwen2 model in bf16, saved as safetensors (lm_head sharpened so greedy paths are stable)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (directory / "model.safetensors").exists():
        return
    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(directory)


def curve(target: TargetModel, device: str, sizes: list[int], prefix: int = 512) -> dict[int, float]:
    state = target.new_state()
    target.prefill(state, [100 + i % 300 for i in range(prefix)])
    out = {}
    for size in sizes:
        time_tree_pass(target, state, size)  # warm-up of the shape
        synchronize(device)
        out[size] = min(time_tree_pass(target, state, size) for _ in range(2))
    return out


def decode(engine: SpeculativeEngine, streamed, method: str, prompt: list[int], tokens: int, device: str) -> dict:
    mode, expansion = METHODS[method]
    options = SpeculationOptions(mode=mode, expansion=expansion, sequence_depth=4, proposers=("ssm",), policy="schedule")
    streamer = streamer_of(streamed)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    before = streamer.stats()
    began = time.perf_counter()
    result = engine.generate(GenerationRequest(tuple(prompt), tokens, speculation=options))
    synchronize(device)
    elapsed = (time.perf_counter() - began) * 1e3
    after = streamer.stats()
    copied = (after.layers_loaded - before.layers_loaded) * bytes_per_layer(streamed)
    return {"method": method, "new_tokens": result.stats.new_tokens, "passes": result.stats.target_steps,
            "ms_per_token": elapsed / result.stats.new_tokens,
            "tokens_per_pass": result.stats.new_tokens / result.stats.target_steps,
            "mb_copied_per_token": copied / 1e6 / result.stats.new_tokens,
            "peak_host_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None,
            "token_ids": list(result.token_ids)}


def bytes_per_layer(streamed) -> int:
    plan = next(iter(streamer_of(streamed).source.plans.values()))
    return sum(p.entry.end - p.entry.offset for p in plan.pieces)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--resident-layers", type=int, default=0)
    parser.add_argument("--prefetch-layers", type=int, default=4)
    parser.add_argument("--ssm-layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "specinfer-gpu-offload")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    directory = args.work / args.shape
    write_model(args.shape, directory)
    import engine.offload as offload

    offload.AutoTokenizer = NoTokenizer  # the random model has no tokenizer; the engine decodes ids
    spec = ModelSpec("target", str(directory), "bfloat16", device=args.device)
    streamed = load_offloaded(spec, OffloadSpec("host", args.resident_layers, args.prefetch_layers)).model
    resident = load_offloaded(spec, OffloadSpec("host", SHAPES[args.shape]["num_hidden_layers"], 1)).model
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    curves = {"streamed": curve(TargetModel(streamed), args.device, sizes),
              "resident": curve(TargetModel(resident), args.device, sizes)}
    ssm = truncate_layers(resident, args.ssm_layers)  # resident weights; the resident target is done
    engine = SpeculativeEngine(TargetModel(streamed), [ModelDrafter(ssm, 0, "ssm")], IdTokenizer(), set())
    prompt = list(range(1000, 1000 + 256)) if args.shape != "tiny" else list(range(10, 74))
    rows = [decode(engine, streamed, method, prompt, args.tokens, args.device) for method in METHODS]
    base = rows[0]["ms_per_token"]
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
              "shape": args.shape, "resident_layers": args.resident_layers, "prefetch_layers": args.prefetch_layers,
              "curves_ms": curves, "rows": rows,
              "outputs_equal_incremental": [r["token_ids"] == rows[0]["token_ids"] for r in rows]}
    args.out.write_text(json.dumps(with_machine(result), indent=1))
    print("tokens/pass -> ms (streamed | resident): " + ", ".join(
        f"{n}: {curves['streamed'][n]:.1f} | {curves['resident'][n]:.1f}" for n in sizes))
    print("| method | ms/token | speedup | tokens/pass | MB copied/token | peak host RSS MB | peak GPU MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        gpu = "–" if r["peak_gpu_mb"] is None else f"{r['peak_gpu_mb']:.0f}"
        print(f"| {r['method']} | {r['ms_per_token']:.1f} | {base / r['ms_per_token']:.2f} | {r['tokens_per_pass']:.2f} "
              f"| {r['mb_copied_per_token']:.0f} | {r['peak_host_rss_mb']:.0f} | {gpu} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
