"""Asynchronous SSM prefetch on one GPU: the SSM drafts on a CUDA stream of its own while the
target verifies on the default stream (the in-process engine, ``engine.generate``).

    python bench/gpu_prefetch.py --out $OUT/gpu_prefetch.json                      # on a GPU machine
    python bench/gpu_prefetch.py --shape tiny --device cpu --out /tmp/p.json       # smoke test

Models shaped like the default pair (Qwen2.5-Coder 1.5B target, 0.5B SSM; ``--shape`` also gives
targets with Qwen2.5-7B's, -14B's or -32B's layers), random bf16 weights, no network and no checkpoint. Random models agree on nothing, so both get a *planted* next-token
rule at full cost (``plant``): every layer's output projections (attention ``o_proj``, MLP
``down_proj``) are zeroed, so the last hidden state is the last token's embedding, and the
lm_head rows are embedding rows permuted, so the greedy next token after ``x`` is ``rule[x]``
whatever came before. Every matmul and the attention over the whole KV cache still run, so the
passes cost what the real shapes cost. The SSM's rule is the target's on a share ``--agreement``
of the tokens (a random other successor elsewhere), which sets acceptance and so the hit rate:
a whole path of depth D is accepted with the SSM's next token after it with chance about
``agreement ** (D + 1)`` (0.43 for 0.9 and the default depth 7), and after a rejection the target's
token is random to the SSM, so the cut guesses miss: a pessimistic hit rate next to real models'.
The target's greedy output is known without the engine (follow its rule from the last prompt
token): every method must produce it (``outputs_follow_the_target``).

Methods, interleaved per prompt: incremental decoding, the tree with prefetch off, the tree with
prefetch on. Prints the table of docs/benchmark-history.md's "Asynchronous SSM prefetch" (tokens/s, step ms,
waiting for drafts, verify ms, hit rate, saved ms per step) and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_common import IdTokenizer, synchronize  # noqa: E402
from engine.draft import ModelDrafter  # noqa: E402
from engine.generate import SpeculativeEngine  # noqa: E402
from engine.graphed_models import GraphedDrafter, GraphedTarget  # noqa: E402
from engine.graphs import GraphRunner  # noqa: E402
from engine.requests import GenerationRequest, SpeculationOptions  # noqa: E402
from engine.target import TargetModel  # noqa: E402
from bench.machine import with_machine  # noqa: E402

QWEN = {"vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": False}
QWEN_05B = {**QWEN, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2}  # the SSM of every Qwen shape
SHAPES = {  # (target, SSM): Qwen2.5-Coder 1.5B and 0.5B; "tiny" for a CPU smoke test
    "qwen2.5-1.5b+0.5b": (
        {**QWEN, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
         "num_attention_heads": 12, "num_key_value_heads": 2},
        QWEN_05B),
    "qwen2.5-7b+0.5b": (  # a 7B target (Qwen2.5-7B's layers; the SSM's vocabulary, which planted rules share)
        {**QWEN, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
         "num_attention_heads": 28, "num_key_value_heads": 4},
        QWEN_05B),
    "qwen2.5-14b+0.5b": (  # Qwen2.5-14B's layers (about 30 GB in bf16)
        {**QWEN, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
         "num_attention_heads": 40, "num_key_value_heads": 8},
        QWEN_05B),
    "qwen2.5-32b+0.5b": (  # Qwen2.5-32B's layers (about 65 GB in bf16)
        {**QWEN, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
         "num_attention_heads": 40, "num_key_value_heads": 8},
        QWEN_05B),
    "tiny": (
        {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
         "tie_word_embeddings": False},
        {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
         "tie_word_embeddings": False}),
}
EAGER = ("incremental", "tree, prefetch off", "tree, prefetch on")
GRAPHED = ("incremental, graphs", "tree, graphs", "tree, graphs, prefetch on")  # engine.graphs: CUDA graphs
METHODS = EAGER + GRAPHED


def rules(vocab: int, agreement: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:  # -> [V], [V]
    """(target's successor, SSM's successor): random permutations of the vocabulary that agree on
    a share ``agreement`` of the tokens (the others' successors are shuffled among themselves).
    Example: agreement 1.0 -> the same permutation twice."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.randperm(vocab, generator=generator)
    ssm = target.clone()
    differ = torch.randperm(vocab, generator=generator)[:round((1.0 - agreement) * vocab)]
    ssm[differ] = target[differ[torch.randperm(len(differ), generator=generator)]]
    return target, ssm


@torch.no_grad()
def plant(model, successor: torch.Tensor) -> None:  # successor [V]: a permutation
    """Make ``successor[x]`` the model's greedy next token after ``x``, at full cost (module docstring)."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    inverse = torch.empty_like(successor)
    inverse[successor] = torch.arange(len(successor))
    embed = model.model.embed_tokens.weight  # [V, H]
    model.lm_head.weight.copy_(embed[inverse.to(embed.device)])  # row y: the embedding of the token y follows


def build_model(config: dict, device: str, dtype: torch.dtype, successor: torch.Tensor, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its dtype: a 32B model made in float32 first would not fit
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(Qwen2Config(**config))
    finally:
        torch.set_default_dtype(previous)
    model = model.to(dtype).eval()
    plant(model, successor)
    return model


class PlantedPair(NamedTuple):
    """A target and an SSM of one ``SHAPES`` entry with planted rules (``build_pair``). A named
    tuple, not a dataclass: the tests load this script by path, outside ``sys.modules``."""

    target: torch.nn.Module
    ssm: torch.nn.Module
    target_rule: torch.Tensor  # [V]: the target's greedy successor of each token
    dtype: torch.dtype
    vocab_size: int


def add_pair_arguments(parser: argparse.ArgumentParser, tokens: int) -> None:
    """The options of the planted pair and its requests, shared by the GPU bench scripts."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b+0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--agreement", type=float, default=0.9,
                        help="share of tokens where the SSM's rule is the target's (sets acceptance)")
    parser.add_argument("--expansion", default="2,1,1,1,1,1,1", help="the tree's schedule (the default config's)")


def build_pair(args: argparse.Namespace, seed: int) -> PlantedPair:
    """The ``--shape`` pair on ``--device`` in ``--dtype``, its rules agreeing on ``--agreement``."""
    target_config, ssm_config = SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    target_rule, ssm_rule = rules(target_config["vocab_size"], args.agreement, seed)
    return PlantedPair(build_model(target_config, args.device, dtype, target_rule, seed + 1),
                       build_model(ssm_config, args.device, dtype, ssm_rule, seed + 2),
                       target_rule, dtype, target_config["vocab_size"])


def random_prompts(vocab_size: int, count: int, tokens: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` ids drawn uniformly from the vocabulary (a planted pair follows
    its rule whatever the prompt), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (tokens,), generator=generator).tolist() for _ in range(count)]


def graphed_engine(target, ssm, capacity: int) -> SpeculativeEngine:
    """The in-process engine over CUDA graphs (``engine.graphs``; eager on the CPU), one SSM."""
    return SpeculativeEngine(GraphedTarget(GraphRunner(target, capacity)),
                             [GraphedDrafter(GraphRunner(ssm, capacity), 0, "ssm")], IdTokenizer(), set())


def buffer_slots(prompt_tokens: int, tokens: int) -> int:
    """KV slots for a request: its prompt and output, then room for a tree's nodes and a draft's levels."""
    return prompt_tokens + tokens + 256


def follow(rule: torch.Tensor, last: int, count: int) -> list[int]:
    """The target's greedy output: its rule applied ``count`` times from the last prompt token."""
    out = []
    for _ in range(count):
        last = int(rule[last])
        out.append(last)
    return out


def options(method: str, expansion: tuple[int, ...], prefetch: int) -> SpeculationOptions:
    if method.startswith("incremental"):
        return SpeculationOptions(mode="incremental", adaptive=False)
    return SpeculationOptions(mode="tree", expansion=expansion, max_tree_nodes=64, min_confidence=0.0,
                              adaptive=False, prefetch=prefetch if method.endswith("on") else 0)


def run_one(engine: SpeculativeEngine, method: str, prompt: list[int], tokens: int, expansion: tuple[int, ...],
            prefetch: int, device: str) -> dict:
    synchronize(device)
    began = time.perf_counter()
    result = engine.generate(GenerationRequest(tuple(prompt), tokens, speculation=options(method, expansion, prefetch)))
    synchronize(device)
    s = result.stats
    steps = max(1, s.target_steps - 1)  # decode steps (the first pass is the prefill)
    return {"method": method, "total_ms": (time.perf_counter() - began) * 1e3, "new_tokens": s.new_tokens,
            "decode_ms": s.draft_ms + s.verify_ms, "steps": steps, "step_ms": (s.draft_ms + s.verify_ms) / steps,
            "draft_wait_ms": s.draft_ms / steps, "verify_ms": s.verify_ms / steps,
            "prefetch_hits": s.prefetch_hits, "prefetch_misses": s.prefetch_misses,
            "saved_ms_per_step": s.prefetch_saved_ms / steps, "token_ids": list(result.token_ids)}


def summarize(rows: list[dict], methods: tuple[str, ...] = METHODS) -> list[dict]:
    """Per method: medians over prompts; decode tokens/s counts the tokens after the first."""
    table = []
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        tried = sum(r["prefetch_hits"] + r["prefetch_misses"] for r in mine)
        table.append({
            "method": method,
            "tokens_per_s": statistics.median(r["new_tokens"] / r["total_ms"] * 1e3 for r in mine),
            "decode_tokens_per_s": statistics.median((r["new_tokens"] - 1) / r["decode_ms"] * 1e3 for r in mine),
            "tokens_per_step": statistics.median((r["new_tokens"] - 1) / r["steps"] for r in mine),
            **{k: statistics.median(r[k] for r in mine) for k in ("step_ms", "draft_wait_ms", "verify_ms",
                                                                     "saved_ms_per_step")},
            "hit_rate": sum(r["prefetch_hits"] for r in mine) / tried if tried else None,
        })
    return table


def print_table(table: list[dict]) -> None:
    base = table[0]["decode_tokens_per_s"]
    print(f"| method | tokens/s | decode tokens/s | vs {table[0]['method']} | tokens/step | step ms | waiting for drafts "
          "| verify | hit rate | saved ms/step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in table:
        hit = "–" if t["hit_rate"] is None else f"{t['hit_rate']:.2f}"
        print(f"| {t['method']} | {t['tokens_per_s']:.1f} | {t['decode_tokens_per_s']:.1f} "
              f"| {t['decode_tokens_per_s'] / base:.2f} | {t['tokens_per_step']:.2f} | {t['step_ms']:.1f} "
              f"| {t['draft_wait_ms']:.1f} | {t['verify_ms']:.1f} | {hit} | {t['saved_ms_per_step']:.1f} |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_pair_arguments(parser, tokens=128)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prefetch", type=int, default=2, help="outcomes drafted ahead per step")
    parser.add_argument("--methods", default=",".join(METHODS).replace(", ", "/"),
                        help="which methods, comma-separated, with '/' for ', ' (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    methods = tuple(m.replace("/", ", ") for m in args.methods.split(","))
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; known: {list(METHODS)}")
    pair = build_pair(args, args.seed)
    target, ssm, target_rule = pair.target, pair.ssm, pair.target_rule
    engines = {method: SpeculativeEngine(TargetModel(target), [ModelDrafter(ssm, 0, "ssm")], IdTokenizer(), set())
               for method in methods if method in EAGER}
    began = time.perf_counter()
    if set(methods) & set(GRAPHED):
        graphed = graphed_engine(target, ssm, buffer_slots(args.prompt_tokens, args.tokens))
        engines.update({method: graphed for method in methods if method in GRAPHED})
    capture_s = time.perf_counter() - began
    expansion = tuple(int(k) for k in args.expansion.split(","))
    prompts = random_prompts(pair.vocab_size, args.prompts, args.prompt_tokens, args.seed + 3)
    for method in methods:  # warm-up: kernels, allocator, the prefetch thread
        run_one(engines[method], method, prompts[0][:16], 8, expansion, args.prefetch, args.device)
    rows = []
    for index, prompt in enumerate(prompts):
        turn = index % len(methods)
        for method in methods[turn:] + methods[:turn]:  # interleaved, each method first in turn
            row = run_one(engines[method], method, prompt, args.tokens, expansion, args.prefetch, args.device)
            row["follows_the_target"] = row["token_ids"] == follow(target_rule, prompt[-1], args.tokens)
            rows.append(row)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    result = {"device": device, "shape": args.shape, "dtype": args.dtype, "agreement": args.agreement,
              "expansion": list(expansion), "prefetch": args.prefetch, "prompts": args.prompts,
              "prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "graph_capture_s": capture_s,
              "outputs_follow_the_target": all(r["follows_the_target"] for r in rows),
              "table": summarize(rows, methods), "rows": rows}
    args.out.write_text(json.dumps(with_machine(result), indent=1))
    print(f"{device}, {args.shape}, {args.dtype}, agreement {args.agreement}, {args.prompts} prompts x {args.tokens} "
          f"tokens; every output is the target's own: {result['outputs_follow_the_target']}; "
          f"capturing the graphs took {capture_s:.1f} s")
    print_table(result["table"])
    return result


if __name__ == "__main__":
    main()
