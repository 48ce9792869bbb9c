"""In-process vs served (gRPC) ms/token on the default pair, with a per-hop profile of each step.

    python bench/experiments/served_overhead.py --config configs/serve.yaml --out bench/results/served-overhead.json

Both sides run the same engine settings: the served path with continuous batching off (so no
tree budget either), which is what the in-process engine runs. A server is started as
`specinfer serve --no-batching` on a free port; then, ``--repeats`` times, each prompt goes
through the in-process engine and through gRPC, interleaved. Reported per prompt: the median
ms/token of each path (in-process: the engine's own clock; gRPC: the client's wall clock per
call, so proxy and replica hops count), the overhead, and the per-step time by hop
(``GenerationStats.hop_ms``: draft, merge, verify, transport). Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.headline import PROMPTS, encode  # the headline prompts (docs/benchmark-history.md)
from bench.machine import with_machine


def start_server(config: str, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "cluster.cli", "serve", "--config", config, "--grpc-port", str(port),
               "--no-batching"]
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def in_process(engine, options, prompt: str, chat: bool, max_new_tokens: int) -> dict:
    """``options``: the config's speculation, as the server applies it to a request that sets none."""
    from engine.requests import GenerationRequest

    began = time.perf_counter()
    ids = tuple(encode(engine.tokenizer, prompt, chat))
    result = engine.generate(GenerationRequest(ids, max_new_tokens, speculation=options))
    wall = (time.perf_counter() - began) * 1e3
    stats = result.stats
    return {"token_ids": list(result.token_ids), "ms_per_token": stats.ms_per_token,
            "wall_ms_per_token": wall / stats.new_tokens, "steps": stats.target_steps - 1,
            "hop_ms": dict(stats.hop_ms), "new_tokens": stats.new_tokens,
            "draft_ms": stats.draft_ms, "verify_ms": stats.verify_ms}


def served(client, prompt: str, chat: bool, max_new_tokens: int) -> dict:
    from cluster.serve_client import build_request, stats_dict

    request = build_request(None if chat else prompt, [("user", prompt)] if chat else (),
                            max_new_tokens=max_new_tokens)
    began = time.perf_counter()
    response = client.generate(request, timeout=600)
    wall = (time.perf_counter() - began) * 1e3
    stats = stats_dict(response.stats)
    return {"token_ids": list(response.token_ids), "ms_per_token": stats["ms_per_token"],
            "wall_ms_per_token": wall / stats["new_tokens"], "steps": stats["target_steps"] - 1,
            "hop_ms": stats.get("hop_ms", {}), "new_tokens": stats["new_tokens"],
            "draft_ms": stats["draft_ms"], "verify_ms": stats["verify_ms"]}


def summarize(rows: list[dict]) -> dict:
    """Per prompt: medians of each path, the overhead, and the mean per-step hop profile."""
    summary = {}
    for name in PROMPTS:
        local = [r["local"] for r in rows if r["prompt"] == name]
        remote = [r["grpc"] for r in rows if r["prompt"] == name]
        med_local = statistics.median(r["wall_ms_per_token"] for r in local)
        med_remote = statistics.median(r["wall_ms_per_token"] for r in remote)
        summary[name] = {
            "in_process_ms_per_token": med_local, "grpc_ms_per_token": med_remote,
            "overhead": med_remote / med_local - 1.0,
            "grpc_server_ms_per_token": statistics.median(r["ms_per_token"] for r in remote),
            "same_tokens": all(a["token_ids"] == b["token_ids"] for a, b in zip(local, remote)),
            "hop_ms_per_step": {side: hop_profile(runs) for side, runs in (("in_process", local), ("grpc", remote))},
        }
    return summary


def hop_profile(runs: list[dict]) -> dict:
    """Mean ms per verify step by hop, plus the ingress-side split (drafting incl. its calls, verify)."""
    steps = sum(r["steps"] for r in runs) or 1
    hops = {hop for r in runs for hop in r["hop_ms"]}
    profile = {hop: sum(r["hop_ms"].get(hop, 0.0) for r in runs) / steps for hop in sorted(hops)}
    for key in ("draft_ms", "verify_ms"):
        profile[f"caller_{key}"] = sum(r[key] for r in runs) / steps
    return profile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/serve.yaml")
    parser.add_argument("--out", default="bench/out/served-overhead.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    args = parser.parse_args()
    from cluster.build import build_engine, speculation_options
    from cluster.local_ray import free_port
    from cluster.serve_client import Client
    from settings.config import load_config

    port, log = free_port(), Path(tempfile.gettempdir()) / "specinfer-served-overhead.log"
    server = start_server(args.config, port, log)
    try:
        config = load_config(args.config)
        engine = build_engine(config)
        with Client(f"127.0.0.1:{port}") as client:
            client.wait_ready(args.ready_timeout)
            rows = run(engine, speculation_options(config), client, args.repeats, args.max_new_tokens)
    finally:
        server.send_signal(2)
        server.wait(120)
    result = {"config": args.config, "dtype": config.dtype, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "batching": False, "summary": summarize(rows), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(with_machine(result), indent=1))
    print(json.dumps(result["summary"], indent=1))
    return 0


def run(engine, options, client, repeats: int, max_new_tokens: int) -> list[dict]:
    """Warm both paths up, then interleave: each prompt in-process, then through gRPC."""
    in_process(engine, options, "warm up", False, 8)
    served(client, "warm up", False, 8)
    rows = []
    for repeat in range(repeats):
        for name, (prompt, chat) in PROMPTS.items():
            local = in_process(engine, options, prompt, chat, max_new_tokens)
            remote = served(client, prompt, chat, max_new_tokens)
            rows.append({"repeat": repeat, "prompt": name, "local": local, "grpc": remote})
            print(f"[{repeat}] {name}: in-process {local['wall_ms_per_token']:.1f} ms/tok, "
                  f"gRPC {remote['wall_ms_per_token']:.1f} ms/tok", file=sys.stderr)
    return rows


if __name__ == "__main__":
    sys.exit(main())
