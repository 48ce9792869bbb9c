"""`specinfer models fetch` and `specinfer generate`."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from typing import TYPE_CHECKING, get_args

from settings.config import Dtype, EngineConfig, load_config

if TYPE_CHECKING:  # the engine (torch, transformers) is imported by the commands that run it, not by `--help`
    from engine.requests import GenerationRequest


def add_parsers(subparsers) -> None:
    models = subparsers.add_parser("models", help="manage model weights")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    fetch = models_sub.add_parser("fetch", help="download, assemble, verify and convert the default models")
    fetch.add_argument("--cache-dir", type=Path, default=None, help="default: $SPECINFER_MODELS or ~/.cache/specinfer/models")
    fetch.add_argument("--jobs", type=positive_int, default=1,
                       help="models fetched and converted at once, each in a process (default 1; a conversion "
                            "uses one core and up to ~8 GB)")
    fetch.add_argument("names", nargs="*", help="models to fetch (default: all known)")
    fetch.set_defaults(handler=run_fetch)

    gen = subparsers.add_parser("generate", help="generate text in-process")
    gen.add_argument("--config", required=True, help="engine config or Serve config (YAML)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=None)
    gen.add_argument("--mode", choices=["incremental", "sequence", "tree"], default=None)
    gen.add_argument("--dtype", choices=get_args(Dtype), default=None,
                     help="override the config's dtype (auto: bfloat16 where the CPU or GPU has native bf16, else "
                          "float32; greedy output is exact in float32)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    add_sampling_arguments(gen)
    gen.set_defaults(handler=run_generate)


def add_sampling_arguments(parser) -> None:
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default from config)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--children", choices=["top_k", "sampled", "sampled_without_replacement"], default=None)
    parser.add_argument("--no-adaptive", dest="adaptive", action="store_false", default=None,
                        help="tree shapes from this request alone (no global suffix store, no cost-aware sizes): "
                             "a seeded request gives the same tokens whatever else ran")
    parser.add_argument("--prefetch", type=int, default=None, metavar="N",
                        help="each SSM drafts the next tree during verification for N guessed outcomes (0: off; "
                             "default from config); in-process a thread drafts ahead while this one verifies")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run_fetch(args) -> int:
    from .fetch import default_cache_dir, fetch_models

    paths = fetch_models(args.cache_dir or default_cache_dir(), args.names or None, jobs=args.jobs)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def request_from_args(config: EngineConfig, args, prompt_ids: list[int]) -> GenerationRequest:
    from engine.requests import GenerationRequest
    from engine.sampling import SamplingParams

    from .build import speculation_options

    d = config.defaults
    sampling = SamplingParams(
        temperature=d.temperature if args.temperature is None else args.temperature,
        top_k=d.top_k if args.top_k is None else args.top_k,
        top_p=d.top_p if args.top_p is None else args.top_p,
        seed=args.seed,
    )
    options = speculation_options(config)
    changes = {k: v for k, v in (("mode", args.mode), ("children", args.children), ("adaptive", args.adaptive),
                                 ("prefetch", args.prefetch)) if v is not None}
    if changes:
        options = type(options)(**{**options.__dict__, **changes})
    return GenerationRequest(tuple(prompt_ids), args.max_new_tokens or d.max_new_tokens, sampling, options,
                             tuple(args.stop))


def run_generate(args) -> int:
    from .build import build_engine, close_engine

    config = load_config(args.config, dtype=args.dtype)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the answer only (libraries log there)
        engine = build_engine(config)
        try:
            request = request_from_args(config, args, encode_prompt(engine.tokenizer, args.prompt, args.chat))
            result = engine.generate(request)
        finally:
            close_engine(engine)
    stats = result.stats.to_dict()
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": list(result.token_ids),
                          "finish_reason": result.finish_reason, **stats}))
        return 0
    print(result.text)
    print(f"[{stats['mode']}] {stats['new_tokens']} tokens in {stats['target_steps']} target steps: "
          f"{stats['tokens_per_step']:.2f} tokens/step, {stats['ms_per_token']:.1f} ms/token "
          f"(draft {stats['draft_ms']:.0f} ms, verify {stats['verify_ms']:.0f} ms); "
          f"accepted per SSM {stats['accepted_per_proposer']}, per depth {stats['accepted_per_depth']}",
          file=sys.stderr)
    return 0
