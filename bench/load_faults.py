"""Concurrent streams against a served config, with admission raised to fit: errors, tok/s, pools.

    python bench/load_faults.py --config configs/serve.yaml --streams 32 --max-new-tokens 128 \
        --out bench/results/load-32x128-bf16.json

Starts a local Ray node and the config's Serve application in this process (free ports, or
``--grpc-port``), with ``server.max_concurrent_requests`` = streams and every actor's
``max_concurrency`` = ``concurrency_for(streams)`` (each running request has at most one call in
flight per actor; the rest is room for releases and monitoring calls). Then ``streams`` threads
each send one ``GenerateStream`` at once (greedy, prompts cycled) and read it to its end. Printed
(and written to ``--out``): errors (goal 0) with examples, aggregate tokens/s (new tokens of every
request / wall time from the first send to the last end), per-request finish reasons, and the
KV pool counts (free, unreserved, total blocks) of the verifier and each SSM once every request
has ended; ``settled`` is true when each pool is back to its total and no actor holds a request.
Each process's memory (VmRSS, RssAnon, RssFile, VmHWM in MB: the ingress and every actor) is read
once the server is ready and again after the streams (``memory_mb_ready``, ``memory_mb_after``).
Stops Serve and Ray when done. Bounded: every call has a deadline (``--timeout``).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from bench.machine import with_machine

PROMPTS = ["def quicksort(arr):\n", "The history of the printing press begins",
           "class LRUCache:\n    def __init__(self, capacity):\n", "Explain what a KV cache is.",
           "import numpy as np\n\ndef softmax(x):\n", "Once upon a time, in a small village,",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "SELECT name, COUNT(*) FROM"]


def concurrency_for(streams: int) -> int:
    """Actor threads for ``streams`` running requests: one call each, plus half again for releases
    and monitoring calls (32 streams -> 48)."""
    return streams + max(8, streams // 2)


def load_args(args: dict, streams: int) -> dict:
    """The engine args with admission and every actor's max_concurrency raised for ``streams``."""
    threads = concurrency_for(streams)
    server = dict(args.get("server", {}))
    server["max_concurrent_requests"] = streams
    for key in ("ssm_actor", "merge_actor"):
        server[key] = {**server.get(key, {}), "max_concurrency": threads}
    verifier = dict(args.get("verifier", {}))
    verifier["actor"] = {**verifier.get("actor", {}), "max_concurrency": threads}
    return {**args, "server": server, "verifier": verifier}


def run_streams(address: str, streams: int, max_new_tokens: int, timeout_s: float) -> dict:
    """``streams`` concurrent GenerateStream calls; per request its tokens, finish reason or error."""
    import grpc

    from cluster.serve_client import FINISH_NAMES, Client, build_request

    results: list[dict] = [{} for _ in range(streams)]
    barrier = threading.Barrier(streams + 1)

    def one(index: int) -> None:
        with Client(address) as client:
            barrier.wait()
            tokens, reason = [], None
            try:
                for chunk in client.stream(build_request(PROMPTS[index % len(PROMPTS)], max_new_tokens=max_new_tokens,
                                                         temperature=0.0), timeout=timeout_s):
                    tokens.extend(chunk.token_ids)
                    reason = FINISH_NAMES.get(chunk.finish_reason) or reason
                results[index] = {"tokens": len(tokens), "finish_reason": reason}
            except grpc.RpcError as error:
                results[index] = {"tokens": len(tokens), "error": f"{error.code().name}: {error.details()}"}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    errors = [r["error"] for r in results if "error" in r]
    tokens = sum(r["tokens"] for r in results if "error" not in r)
    return {"streams": streams, "max_new_tokens": max_new_tokens, "errors": len(errors),
            "error_examples": sorted(set(errors))[:5], "new_tokens": tokens, "wall_s": round(wall, 1),
            "aggregate_tokens_per_s": round(tokens / wall, 2),
            "finish_reasons": {r: sum(x.get("finish_reason") == r for x in results) for r in ("length", "stop")}}


def pool_report(timeout_s: float = 60.0) -> dict:
    """Each pool's (free, unreserved, total) and each actor's request count, once settled or after
    ``timeout_s``."""
    import ray
    from ray import serve

    from settings.config import APP_NAME

    actors = serve.get_app_handle(APP_NAME).actors.remote().result()
    deadline = time.monotonic() + timeout_s
    while True:
        paged = {name: actor for name, actor in actors.items() if name != "merge"}  # merge has no pool
        pools = dict(zip(paged, ray.get([a.pool_blocks.remote() for a in paged.values()])))
        held = dict(zip(actors, ray.get([a.num_requests.remote() for a in actors.values()])))
        settled = (not any(held.values()) and all(p is None or p[0] == p[1] == p[2] for p in pools.values()))
        if settled or time.monotonic() > deadline:
            return {"pools_free_unreserved_total": {k: v for k, v in pools.items() if v is not None},
                    "requests_held": held, "settled": settled}
        time.sleep(0.5)


def memory_report() -> dict[str, dict[str, float]]:
    """Each process's memory in MB by role: the ingress replica, the verifier, merge, ssm/<name>."""
    import ray
    from ray import serve

    from settings.config import APP_NAME

    handle = serve.get_app_handle(APP_NAME)
    actors = handle.actors.remote().result()
    memory = dict(zip(actors, ray.get([a.memory.remote() for a in actors.values()])))
    return {"ingress": handle.memory.remote().result(), **memory}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/serve.yaml", help="a Serve config (default %(default)s)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=1500.0, help="deadline of each call in seconds")
    parser.add_argument("--grpc-port", type=int, default=None)
    parser.add_argument("--num-cpus", type=float, default=None, help="logical CPUs of the local Ray node")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)

    from bench.local_app import start_app
    from cluster.cli_serve import stop_serving

    try:
        began = time.perf_counter()
        address = start_app(args.config, lambda engine: load_args(engine, args.streams), 900, args.grpc_port,
                            args.num_cpus)
        figures = {"config": args.config, "startup_s": round(time.perf_counter() - began, 1),
                   "actor_max_concurrency": concurrency_for(args.streams), "memory_mb_ready": memory_report()}
        figures.update(run_streams(address, args.streams, args.max_new_tokens, args.timeout))
        figures.update(pool_report())
        figures["memory_mb_after"] = memory_report()
    finally:
        stop_serving()
    print(json.dumps(figures, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(with_machine(figures), indent=1) + "\n")
    return 0 if figures["errors"] == 0 and figures["settled"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
