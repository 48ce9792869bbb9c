"""Faults survived: kill model actors under streaming load and count what clients saw.

    python -m bench.faults --config configs/smollm2-fp32.yaml --out bench/results/faults.json

Starts a local Ray node and Serve on loopback with free ports, deploys the config's engine (fp32,
so greedy output is exact), and computes each prompt's reference ids with the in-process engine.
Then, fault by fault (``--ssm-kills`` kills of the first SSM actor, ``--merge-kills`` of the
merge actor, one of the verifier): ``--streams`` streams start, each reads its first chunk, the
actor is killed, and the streams are read to the end. Printed per fault: streams sent, failed
(with their gRPC codes), outputs identical to the reference, seconds from the kill until health
answers SERVING again and until the ingress saw the actor answer again (``recoveries``), and, for
the verifier, how fast the in-flight streams failed plus a request served after the rebuild.
Everything stops by itself; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from bench.machine import with_machine

PROMPTS = ["def quicksort(arr):\n", "The history of the printing press begins",
           "Explain what a KV cache is in two sentences."]
HEALTH = {"probe_timeout_s": 1.0, "retry_interval_s": 0.5}


@dataclass
class FaultResult:
    fault: str
    streams: int
    failed: int = 0
    codes: list[str] = field(default_factory=list)
    identical: int = 0
    fail_s: list[float] = field(default_factory=list)  # kill -> in-flight stream's error
    serving_again_s: float | None = None  # kill -> health SERVING
    answered_again_s: float | None = None  # failure seen -> the ingress's probe answered (Recovery)
    after_rebuild_identical: bool | None = None


def engine_args(config_path: str, max_new_tokens: int, streams: int) -> dict:
    from settings.config import load_config

    config = load_config(config_path).model_dump(mode="json")
    actor = {"num_cpus": 0.25, "torch_threads": 1, "max_concurrency": 2 * streams + 4}
    config["verifier"] = {**config["verifier"], "actor": actor}
    config["server"] = {**config["server"], "ssm_actor": actor, "merge_actor": actor, "health": HEALTH,
                        "max_concurrent_requests": max(8, streams), "max_new_tokens_limit": max_new_tokens}
    return config


def start(args: dict, deployments: list[dict] | None = None) -> tuple[str, object]:
    """Local Ray + Serve with free loopback ports; the gRPC address and the app's Serve handle.
    ``deployments``: the app's Serve deployment options (``bench.local_app.start_app``)."""
    from ray import serve

    from bench.local_app import start_app
    from settings.config import APP_NAME

    serve_yaml = str(Path(__file__).resolve().parent.parent / "configs" / "serve.yaml")  # its proxies, our args
    address = start_app(serve_yaml, lambda _: args, 600, num_cpus=4, object_store_memory=300 * 2**20,
                        deployments=deployments)
    return address, serve.get_app_handle(APP_NAME)


def references(config_path: str, args: dict, max_new_tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy ids from the in-process engine on the same config."""
    from cluster.build import build_engine, close_engine, speculation_options
    from engine.requests import GenerationRequest
    from settings.config import EngineConfig

    config = EngineConfig.model_validate(args)
    engine = build_engine(config)
    try:
        options = speculation_options(config)
        return {p: list(engine.generate(GenerationRequest(tuple(engine.tokenizer.encode(p)), max_new_tokens,
                                                          speculation=options)).token_ids) for p in PROMPTS}
    finally:
        close_engine(engine)


def wait_for(predicate, timeout_s: float, poll_s: float = 0.1) -> float | None:
    """Seconds until ``predicate`` held, None when it did not within ``timeout_s``."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if predicate():
            return time.monotonic() - began
        time.sleep(poll_s)
    return None


def run_streams(client, expected: dict[str, list[int]], streams: int, max_new_tokens: int, kill, result: FaultResult):
    """``streams`` streams read their first chunk, ``kill()`` runs, then each is read to its end."""
    import grpc

    from cluster.serve_client import build_request

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
    calls = [client.stream(build_request(p, max_new_tokens=max_new_tokens), timeout=600) for p in prompts]
    firsts = [list(next(call).token_ids) for call in calls]
    killed = kill()
    lock = threading.Lock()

    def read(prompt, call, ids):
        try:
            ids = ids + [t for chunk in call for t in chunk.token_ids]
        except grpc.RpcError as error:
            with lock:
                result.failed += 1
                result.codes.append(error.code().name)
                result.fail_s.append(round(time.monotonic() - killed, 2))
            return
        with lock:
            result.identical += ids == expected[prompt]

    threads = [threading.Thread(target=read, args=job) for job in zip(prompts, calls, firsts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return killed


def inject(client, app, expected, role: str, streams: int, max_new_tokens: int) -> FaultResult:
    """One fault: kill ``role`` under ``streams`` streams; wait for the actor to be back."""
    import ray

    result = FaultResult(role, streams)
    before = len(app.recoveries.remote().result())

    def kill() -> float:
        ray.kill(app.actors.remote().result()[role], no_restart=False)
        return time.monotonic()

    killed = run_streams(client, expected, streams, max_new_tokens, kill, result)
    back = wait_for(lambda: client.serving(5), 300, poll_s=0.2)
    result.serving_again_s = None if back is None else round(time.monotonic() - killed, 2)
    wait_for(lambda: len(app.recoveries.remote().result()) > before, 60, poll_s=0.2)
    new = [r for r in app.recoveries.remote().result()[before:] if r.role == role]
    result.answered_again_s = round(new[0].down_s, 2) if new else None
    if role == "verifier":
        prompt = PROMPTS[0]
        from cluster.serve_client import build_request

        reply = client.generate(build_request(prompt, max_new_tokens=max_new_tokens), timeout=600)
        result.after_rebuild_identical = list(reply.token_ids) == expected[prompt]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-fp32.yaml")
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--ssm-kills", type=int, default=3)
    parser.add_argument("--merge-kills", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args(argv)

    import ray
    from ray import serve

    from cluster.serve_client import Client

    args = engine_args(options.config, options.max_new_tokens, options.streams)
    expected = references(options.config, args, options.max_new_tokens)
    address, app = start(args)
    ssm = "ssm/" + args["ssms"][0]["name"]
    schedule = [ssm] * options.ssm_kills + ["merge"] * options.merge_kills + ["verifier"]
    results = []
    try:
        with Client(address) as client:
            for role in schedule:
                results.append(inject(client, app, expected, role, options.streams, options.max_new_tokens))
                print(json.dumps(asdict(results[-1])), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    report(results, options)
    return 0


def report(results: list[FaultResult], options) -> None:
    survived = [r for r in results if r.fault != "verifier"]
    summary = {
        "config": options.config, "streams_per_fault": options.streams, "max_new_tokens": options.max_new_tokens,
        "faults_injected": len(results), "requests_sent": sum(r.streams for r in results)
        + sum(r.after_rebuild_identical is not None for r in results),
        "failed_ssm_merge_kills": sum(r.failed for r in survived),
        "identical_ssm_merge_kills": f"{sum(r.identical for r in survived)}/{sum(r.streams for r in survived)}",
        "verifier_in_flight_failed": [f"{r.failed}/{r.streams} {sorted(set(r.codes))} in {r.fail_s} s"
                                      for r in results if r.fault == "verifier"],
        "faults": [asdict(r) for r in results]}
    print(f"{'fault':<28}{'streams':>8}{'failed':>7}{'identical':>10}{'SERVING again s':>16}{'answered again s':>17}")
    for r in results:
        print(f"{r.fault:<28}{r.streams:>8}{r.failed:>7}{r.identical:>10}{r.serving_again_s!s:>16}"
              f"{r.answered_again_s!s:>17}")
    print(json.dumps({k: v for k, v in summary.items() if k != "faults"}, indent=1))
    if options.out:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(json.dumps(with_machine(summary), indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
