"""Tree-verification cost on one GPU: a Llama-8B-shaped target with random bf16 weights.

    python bench/gpu_verify_curve.py --out $OUT/gpu_verify_curve.json          # on a GPU machine
    python bench/gpu_verify_curve.py --shape tiny --device cpu --out /tmp/c.json  # smoke test

Times the engine's own one-pass tree verification (``engine.target.TargetModel.forward_tree``:
tree mask, positions = prefix + depth, KV appended then cropped) for tree sizes 1..128 on top of
a 1k-token prefix, plus the decode time per token (size 1). Needs torch and transformers only (no
Ray, no DeepSpeed at tp=1) and finishes in well under 5 minutes on an H100/H200. The curve says
how large a tree pays on that hardware: while the time stays near the decode time, the target is
memory-bound and a bigger tree is almost free.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_common import synchronize  # noqa: E402
from engine import kv  # noqa: E402
from engine.target import TargetModel  # noqa: E402
from engine.tree import TokenTree  # noqa: E402
from bench.machine import with_machine  # noqa: E402

SHAPES = {  # Llama-3-8B's shape; "tiny" for a CPU smoke test
    "llama-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096},
}


def bushy_tree(size: int, width: int = 4) -> TokenTree:
    """A tree of ``size`` nodes where node i's parent is (i - 1) // width (breadth-first numbering
    is also a valid topological order for the mask). Example: size 6, width 2 -> parents
    [-1, 0, 0, 1, 1, 2]."""
    parents = torch.tensor([-1] + [(i - 1) // width for i in range(1, size)])
    return TokenTree(torch.randint(100, 500, (size,)), parents)


def build_model(shape: str, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def time_tree(target: TargetModel, state, prefix: int, size: int, repeats: int, device: str) -> float:
    """Median ms of one verification forward of a ``size``-node tree on a ``prefix``-token cache."""
    times = []
    for _ in range(repeats + 2):  # two warm-up passes
        tree = bushy_tree(size)
        synchronize(device)
        started = time.perf_counter()
        target.forward_tree(state, tree)
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
        kv.crop(state.cache, prefix)
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--sizes", default="1,4,16,32,64,128")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_verify_curve.json"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    began = time.perf_counter()
    model = build_model(args.shape, args.device, getattr(torch, args.dtype))
    target = TargetModel(model)
    state = target.new_state()
    target.prefill(state, torch.randint(100, 500, (args.prefix,)).tolist())
    curve = {}
    for size in [int(s) for s in args.sizes.split(",")]:
        curve[size] = time_tree(target, state, args.prefix, size, args.repeats, args.device)
        print(f"tree {size:4d} nodes: {curve[size]:8.2f} ms ({curve[size] / curve.get(1, curve[size]):.2f}x decode)",
              flush=True)
    result = {"shape": args.shape, "dtype": args.dtype, "device": _device_name(args.device), "prefix": args.prefix,
              "torch": torch.__version__, "python": platform.python_version(), "decode_ms_per_token": curve.get(1),
              "verify_ms": curve, "wall_s": time.perf_counter() - began}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_machine(result), indent=2))
    return result


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"


if __name__ == "__main__":
    main()
