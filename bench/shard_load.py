"""Host memory and time of loading a target by shard (``actors.sharded``, ``engine.checkpoint``).

    python bench/shard_load.py --model ~/.cache/specinfer/models/qwen2.5-coder-1.5b-instruct --tp 2 \\
        --out bench/results/shard-load/qwen2.5-1.5b-tp2.json                       # the default target
    python bench/shard_load.py --shape qwen2.5-32b --tp 1 --device cuda --workdir /data --out $OUT/l.json  # GPU box
    python bench/shard_load.py --shape small --tp 2 --out /tmp/l.json            # CPU, a small shape

The checkpoint is a model directory (``--model``) or, with ``--shape``, a target of that shape
(``bench/gpu_prefetch.py``'s Qwen shapes) with random weights and ``gpu_prefetch``'s planted
next-token rule, built on the meta device and written to ``--workdir`` as a safetensors file one
tensor at a time (never whole in memory). Then, each in a fresh process so that its peak is its own:

* ``whole``: the full model loaded in-process (``engine.models.load_model``, the single-device
  path: read tensor by tensor onto ``--device``) and run once;
* ``rank N``: with ``--tp`` >= 2, each of N gloo ranks on the CPU reading only its AutoTP shard
  (``actors.sharded.load_rank_shard``, what a tensor-parallel rank actor runs), then one forward;
* ``rank N, whole first`` (``--before``): the ranks as they loaded before, the whole target
  (from_pretrained), then AutoTP's shard of it.

Per process: load seconds, peak RSS (VmHWM) after the load and after the forward, bytes read from
the checkpoint, and the greedy next token of a short prompt (a planted target's must follow its
rule; the ranks' must equal the whole model's). Written as JSON with the machine record.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.common import process_memory  # noqa: E402
from actors.rank_group import remove_shared_memory  # noqa: E402
from bench.machine import with_machine  # noqa: E402
from engine.checkpoint import parameters_on_meta  # noqa: E402
from engine.dtypes import machine_dtype  # noqa: E402
from engine.models import ModelSpec  # noqa: E402

QWEN = {"vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": False}
SHAPES = {  # Qwen2.5 targets' layers (bench/gpu_prefetch.py's), and small ones for a CPU run
    "qwen2.5-1.5b": {**QWEN, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2},
    "qwen2.5-32b": {**QWEN, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
                    "num_attention_heads": 40, "num_key_value_heads": 8},
    "small": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
              "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 4096,
              "tie_word_embeddings": False},
    "tiny": {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
             "tie_word_embeddings": False},
}
SAFETENSORS_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
PROMPT = [11, 7, 3]


def planted_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, rule: torch.Tensor, seed: int):
    """One weight of a planted target (``bench/gpu_prefetch.py``'s ``plant``): output projections
    zero, so the last hidden state is the last token's embedding; the head's row y the embedding of
    the token that y follows; norms one; the rest random (seeded by the tensor's name)."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return torch.zeros(shape, dtype=dtype)
    if "norm" in name:
        return torch.ones(shape, dtype=dtype)
    if name == "lm_head.weight":
        inverse = torch.empty_like(rule)
        inverse[rule] = torch.arange(len(rule))
        return planted_tensor("model.embed_tokens.weight", shape, dtype, rule, seed)[inverse]
    generator = torch.Generator().manual_seed(seed + sum(map(ord, name)) * 7919 + len(name))
    return (torch.randn(shape, generator=generator) * 0.02).to(dtype)


def write_planted(config: dict, directory: Path, dtype: torch.dtype, seed: int) -> torch.Tensor:  # -> rule [V]
    """Write a planted target of ``config`` to ``directory`` (config.json, model.safetensors), one
    tensor in memory at a time; returns its rule (token x -> its greedy successor)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen_config = Qwen2Config(**config, dtype=str(dtype).removeprefix("torch."))
    with parameters_on_meta():
        shapes = {name: tuple(p.shape) for name, p in Qwen2ForCausalLM(qwen_config).named_parameters()}
    rule = torch.randperm(config["vocab_size"], generator=torch.Generator().manual_seed(seed))
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    directory.mkdir(parents=True, exist_ok=True)
    qwen_config.save_pretrained(directory)
    with open(directory / "model.safetensors", "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for name, shape in shapes.items():
            out.write(planted_tensor(name, shape, dtype, rule, seed).contiguous().view(torch.uint8).numpy().tobytes())
    return rule


def next_token(module, device: str) -> int:
    with torch.no_grad():
        return int(module(torch.tensor([PROMPT], device=device)).logits[0, -1].argmax())


def whole_main(directory: str, dtype: str, device: str, queue) -> None:
    """The full model in this process (the single-device load), then one forward."""
    from engine.models import load_model

    began = time.perf_counter()
    loaded = load_model(ModelSpec("whole", directory, dtype=dtype, device=device))
    seconds, memory = time.perf_counter() - began, process_memory()
    queue.put({"process": "whole", "load_s": seconds, "peak_rss_mb_loaded": memory["VmHWM"],
               "next_token": next_token(loaded.model, device), "peak_rss_mb_after_forward": process_memory()["VmHWM"],
               "weights_mb": sum(p.numel() * p.element_size() for p in loaded.model.parameters()) / 2**20})


def rank_main(rank: int, world: int, port: int, directory: str, dtype: str, whole_first: bool, queue) -> None:
    """One gloo rank on the CPU: its AutoTP shard read slice by slice (``whole_first``: as before,
    the whole target from from_pretrained, then sharded by AutoTP), then one forward."""
    from actors.common import DEFAULT_EXTENSIONS_DIR
    from actors.rank_group import rank_environment

    os.environ.update(rank_environment(rank, world, on_gpu=False), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCH_EXTENSIONS_DIR=os.path.expanduser(DEFAULT_EXTENSIONS_DIR))
    from actors.sharded import load_rank_shard

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    began = time.perf_counter()
    if whole_first:
        module, report = whole_then_shard(directory, dtype, world), {"process": f"rank {rank}, whole first"}
    else:
        shard = load_rank_shard(ModelSpec("target", directory, dtype=dtype, device="cpu"), world, rank)
        module, report = shard.module, {"process": f"rank {rank}", "bytes_read": shard.bytes_read}
    seconds, memory = time.perf_counter() - began, process_memory()
    queue.put({**report, "load_s": seconds, "peak_rss_mb_loaded": memory["VmHWM"],
               "next_token": next_token(module, "cpu"), "peak_rss_mb_after_forward": process_memory()["VmHWM"],
               "weights_mb": sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20})
    torch.distributed.destroy_process_group()


def whole_then_shard(directory: str, dtype: str, world: int) -> torch.nn.Module:
    """What a rank did before loading by shard: the whole target, then AutoTP's shard of it."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), use_safetensors=True)
    return deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=getattr(torch, dtype),
                                    replace_with_kernel_inject=False).module.eval()


def run_processes(targets: list[tuple]) -> list[dict]:
    """Run each (function, args) in a fresh spawned process, all at once; their reports."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=function, args=(*args, queue)) for function, args in targets]
    for process in processes:
        process.start()
    reports = [queue.get(timeout=3600) for _ in processes]
    for process in processes:
        process.join()
    return sorted(reports, key=lambda report: report["process"])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a model directory holding safetensors")
    source.add_argument("--shape", choices=sorted(SHAPES), help="a planted random target of this shape")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/specinfer-shard-load"))
    parser.add_argument("--tp", type=int, default=2, help="ranks (gloo, CPU); 1: the single-device load only")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    parser.add_argument("--device", default="cpu", help="where the whole model loads (cpu or cuda)")
    parser.add_argument("--before", action="store_true",
                        help="also measure the ranks as they loaded before: the whole target, then sharded")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    dtype = machine_dtype(args.device.split(":")[0]).dtype if args.dtype == "auto" else args.dtype
    rule, directory, wrote_s = None, args.model, None
    if args.shape:
        directory, began = args.workdir / args.shape, time.perf_counter()
        rule = write_planted(SHAPES[args.shape], directory, getattr(torch, dtype), args.seed)
        wrote_s = time.perf_counter() - began
    directory = str(directory.expanduser())
    reports = run_processes([(whole_main, (directory, dtype, args.device))])
    for whole_first in [False, True][:1 + args.before if args.tp >= 2 else 0]:
        port = free_port()
        try:
            reports += run_processes([(rank_main, (rank, args.tp, port, directory, dtype, whole_first))
                                      for rank in range(args.tp)])
        finally:
            remove_shared_memory("127.0.0.1", port)  # DeepSpeed's CPU all-reduce buffers
    whole = reports[0]
    for report in reports[1:]:
        report["peak_vs_whole"] = report["peak_rss_mb_loaded"] / whole["peak_rss_mb_loaded"]
    result = {"source": args.shape or Path(directory).name, "tp": args.tp, "dtype": dtype, "device": args.device,
              "checkpoint_mb": sum(f.stat().st_size for f in Path(directory).glob("*.safetensors")) / 2**20,
              "write_s": wrote_s, "processes": reports,
              "next_tokens_agree": len({report["next_token"] for report in reports}) == 1,
              "follows_planted_rule": None if rule is None else whole["next_token"] == int(rule[PROMPT[-1]])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_machine(result), indent=1))
    print_table(result)
    return result


def print_table(result: dict) -> None:
    print(f"{result['source']}, {result['dtype']}, checkpoint {result['checkpoint_mb']:.0f} MB, tp {result['tp']}; "
          f"next tokens agree: {result['next_tokens_agree']}; planted rule followed: {result['follows_planted_rule']}")
    print("| process | load s | weights MB | peak RSS MB (loaded) | after a forward | vs whole | GB read |")
    print("|---|---|---|---|---|---|---|")
    for r in result["processes"]:
        read = f"{r['bytes_read'] / 1e9:.2f}" if "bytes_read" in r else "-"
        ratio = f"{r['peak_vs_whole']:.2f}" if "peak_vs_whole" in r else "-"
        print(f"| {r['process']} | {r['load_s']:.1f} | {r['weights_mb']:.0f} | {r['peak_rss_mb_loaded']:.0f} | "
              f"{r['peak_rss_mb_after_forward']:.0f} | {ratio} | {read} |")


if __name__ == "__main__":
    main()
