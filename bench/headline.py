"""Headline figures for the default pair on three prompts (code, prose, chat), in one process.

    python bench/headline.py --out bench/out/headline.json [--max-new-tokens 128] [--grpc 127.0.0.1:9000]

Greedy: incremental, sequence:4 and the config's tree, interleaved prompt by prompt. Sampling
(temperature 1.0): tokens per step of MSS (sampled children), SpecTree (without replacement)
and naive sampling (top-k children) with the same tree budget, over several seeds. With
--grpc, the same greedy tree requests also go through a running server (end-to-end ms/token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from cluster.build import build_engine, forget_responses, speculation_options
from settings.config import load_config
from engine.requests import GenerationRequest
from engine.sampling import SamplingParams
from bench.machine import with_machine

PROMPTS = {
    "code": ("def quicksort(arr):\n", False),
    "prose": ("The history of the printing press begins", False),
    "chat": ("Explain what a KV cache is in two sentences.", True),
}


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer.encode(text)
    templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True)
    return tokenizer.encode(templated, add_special_tokens=False)


def greedy_rows(engine, base, max_new_tokens: int) -> list[dict]:
    methods = {"incremental": replace(base, mode="incremental"), "sequence:4": replace(base, mode="sequence", sequence_depth=4),
               "tree": base}
    rows = []
    for name, (text, chat) in PROMPTS.items():
        ids = tuple(encode(engine.tokenizer, text, chat))
        for method, options in methods.items():
            forget_responses(engine)  # the suffix proposer's global store must not hold this prompt's answer
            result = engine.generate(GenerationRequest(ids, max_new_tokens, speculation=options))
            stats = result.stats.to_dict()
            rows.append({"prompt": name, "method": method, "tokens_per_step": stats["tokens_per_step"],
                         "ms_per_token": stats["ms_per_token"], "new_tokens": stats["new_tokens"],
                         "token_ids": list(result.token_ids)})
            print(rows[-1]["prompt"], method, round(stats["tokens_per_step"], 2), round(stats["ms_per_token"], 1), flush=True)
    return rows


def sampling_rows(engine, base, seeds: int, max_new_tokens: int) -> dict:
    ssm = [name for name, neural in zip(engine.names, engine.neural) if neural][:1]
    out = {}
    for children in ("sampled", "sampled_without_replacement", "top_k"):
        options = replace(base, children=children, proposers=tuple(ssm), min_confidence=0.0, expansion=(2, 2, 1, 1))
        values = []
        for name, (text, chat) in PROMPTS.items():
            ids = tuple(encode(engine.tokenizer, text, chat))
            for seed in range(seeds):
                sampling = SamplingParams(temperature=1.0, seed=seed)
                values.append(engine.generate(GenerationRequest(ids, max_new_tokens, sampling, options)).stats.tokens_per_step)
        out[children] = {"mean_tokens_per_step": statistics.mean(values), "samples": len(values)}
        print(children, out[children], flush=True)
    return out


def grpc_rows(address: str, max_new_tokens: int) -> list[dict]:
    from cluster.serve_client import Client, build_request  # imported lazily: grpc only here

    rows, client = [], Client(address)
    client.generate(build_request("warm up", max_new_tokens=8))
    for name, (text, chat) in PROMPTS.items():
        request = build_request(None if chat else text, [("user", text)] if chat else (), max_new_tokens=max_new_tokens)
        started = time.perf_counter()
        response = client.generate(request)
        elapsed = (time.perf_counter() - started) * 1e3
        rows.append({"prompt": name, "method": "tree-grpc", "ms_per_token": elapsed / max(1, len(response.token_ids)),
                     "server_ms_per_token": response.stats.ms_per_token, "tokens_per_step": response.stats.tokens_per_step,
                     "token_ids": list(response.token_ids)})
        print(name, "grpc", round(rows[-1]["ms_per_token"], 1), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--grpc", default=None)
    parser.add_argument("--skip-sampling", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/out/headline.json"))
    args = parser.parse_args()
    config = load_config(args.config)
    engine = build_engine(config)
    base = speculation_options(config)
    engine.generate(GenerationRequest(tuple(engine.tokenizer.encode("warm up")), 8, speculation=base))
    result = {"config": args.config, "greedy": greedy_rows(engine, base, args.max_new_tokens)}
    if args.grpc:
        result["grpc"] = grpc_rows(args.grpc, args.max_new_tokens)
    if not args.skip_sampling:
        result["sampling_temperature_1"] = sampling_rows(engine, base, args.seeds, 48)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_machine(result), indent=1))


if __name__ == "__main__":
    main()
