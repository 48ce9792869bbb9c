"""Scale-out with load: Serve's autoscaler adds an ingress replica under load and removes it after.

    python -m bench.scale_out --config configs/smollm2-fp32.yaml --out bench/results/scale-out-cpu/scale_out.json

Starts a local Ray node (fractional CPUs: every actor 0.25) and Serve on loopback with free ports,
and deploys the config's engine (fp32: greedy output is exact) with the ingress deployment's
``autoscaling_config`` given as a Serve config gives it (``applications[].deployments[]``, Serve's
own keys): 1 to 2 replicas, a low ``target_ongoing_requests`` and short delays. Then three phases:

* ``low``: one client, requests one after another (one replica);
* ``high``: ``--streams`` clients at once, back to back, until a second replica runs and has
  answered ``--min-on-new`` requests;
* ``fall``: one client again, until the deployment is back to one replica and the replica that left
  has no actor left in the cluster.

Every request is a stream of ``--max-new-tokens`` tokens; the replica that answered it comes from
the response's trailing metadata (``cluster.serve_client.answered_by``), its tokens are compared
with the in-process engine's for the same prompt. Written: requests sent, failed (with gRPC codes),
identical to the reference, per replica and phase, the replica-count timeline (from
``serve.status()``) and each replica's actors. Correctness is what it shows, not speed.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.faults import PROMPTS, engine_args, references, start
from bench.machine import with_machine

INGRESS = "SpecInferIngress"


def autoscaling(target_ongoing_requests: float, downscale_delay_s: float) -> dict:
    """Serve's options for the ingress deployment (an ``applications[].deployments[]`` entry): 1 to
    2 replicas and short delays. Handles report ongoing requests every 10 s, so the look-back
    period is longer than that (Serve warns otherwise)."""
    return {"name": INGRESS, "autoscaling_config": {
        "min_replicas": 1, "initial_replicas": 1, "max_replicas": 2,
        "target_ongoing_requests": target_ongoing_requests, "look_back_period_s": 12.0,
        "upscale_delay_s": 2.0, "downscale_delay_s": downscale_delay_s}}


def replica_states(app: str) -> dict[str, int]:
    """Replicas of the app's ingress per state (RUNNING, STARTING, STOPPING, ...)."""
    from ray import serve

    status = serve.status().applications.get(app)
    deployment = status.deployments.get(INGRESS) if status else None
    return {str(getattr(state, "value", state)): count for state, count in (deployment.replica_states if deployment else {}).items()
            if count}


def replica_actors(app: str) -> dict[str, set[str]]:
    """Live named actors of each replica of ``app``, by replica id: the roles (``verifier``,
    ``ssm/<name>``, ``merge``) of the actors named ``<app>/<replica id>/<role>``."""
    import ray

    actors: dict[str, set[str]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        app_name, _, rest = entry["name"].partition("/")
        replica, _, role = rest.partition("/")
        if app_name == app and role:
            actors.setdefault(replica, set()).add(role)
    return actors


@dataclass
class Tally:
    """What the clients saw, per phase."""

    sent: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)
    identical: Counter = field(default_factory=Counter)
    by_replica: dict[str, Counter] = field(default_factory=dict)
    codes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, phase: str, replica: str | None, ok: bool, same: bool, code: str | None = None) -> None:
        with self.lock:
            self.sent[phase] += 1
            self.failed[phase] += not ok
            self.identical[phase] += same
            if replica is not None:
                self.by_replica.setdefault(phase, Counter())[replica.rpartition("/")[2]] += 1
            if code:
                self.codes.append(code)


def one_request(client, prompt: str, expected: list[int], max_new_tokens: int, phase: str, tally: Tally) -> None:
    """One stream read to its end; the replica from its trailing metadata."""
    import grpc

    from cluster.serve_client import answered_by, build_request

    call = client.stream(build_request(prompt, max_new_tokens=max_new_tokens), timeout=600)
    try:
        ids = [t for chunk in call for t in chunk.token_ids]
    except grpc.RpcError as error:
        tally.record(phase, None, False, False, f"{error.code().name}: {error.details()}")
        return
    tally.record(phase, answered_by(call), True, ids == expected)


def clients(address: str, app: str, count: int, until, phase: str, expected: dict, max_new_tokens: int,
            tally: Tally) -> None:
    """``count`` clients send requests back to back (prompts in turn) until ``until()`` holds."""
    from cluster.serve_client import Client

    def loop(index: int) -> None:
        with Client(address, app) as client:
            sent = index
            while not until():
                prompt = PROMPTS[sent % len(PROMPTS)]
                one_request(client, prompt, expected[prompt], max_new_tokens, phase, tally)
                sent += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


class Timeline:
    """Polls the replica states and the replicas' actors; keeps each change with its time."""

    def __init__(self, app: str, poll_s: float = 0.5):
        self.app, self.poll_s, self.began = app, poll_s, time.monotonic()
        self.changes: list[dict] = []
        self.replicas_seen: dict[str, set[str]] = {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            states, actors = replica_states(self.app), replica_actors(self.app)
            for replica, roles in actors.items():
                self.replicas_seen.setdefault(replica, set()).update(roles)
            entry = {"states": states, "replicas_with_actors": sorted(actors)}
            if not self.changes or {k: v for k, v in self.changes[-1].items() if k != "t_s"} != entry:
                self.changes.append({"t_s": round(time.monotonic() - self.began, 1), **entry})
            self.stopped.wait(self.poll_s)

    def running(self) -> int:
        return replica_states(self.app).get("RUNNING", 0)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def run(address: str, app: str, options, expected: dict) -> dict:
    """The three phases; the counts, the timeline and each replica's actors."""
    tally, timeline = Tally(), Timeline(app)
    first = set(replica_actors(app))
    deadline = time.monotonic() + options.phase_timeout_s

    def new_replica_served() -> bool:
        served = tally.by_replica.get("high", Counter())
        return (timeline.running() >= 2 and any(n >= options.min_on_new for r, n in served.items() if r not in first)) \
            or time.monotonic() > deadline

    low = iter(range(options.low_requests))
    clients(address, app, 1, lambda: next(low, None) is None, "low", expected, options.max_new_tokens, tally)
    clients(address, app, options.streams, new_replica_served, "high", expected, options.max_new_tokens, tally)
    deadline = time.monotonic() + options.phase_timeout_s

    def back_to_one() -> bool:
        states, actors = replica_states(app), replica_actors(app)
        return (states.get("RUNNING") == 1 and sum(states.values()) == 1 and len(actors) == 1) \
            or time.monotonic() > deadline

    clients(address, app, 1, back_to_one, "fall", expected, options.max_new_tokens, tally)
    timeline.stop()
    remaining = replica_actors(app)
    return {"requests_sent": sum(tally.sent.values()), "failed": sum(tally.failed.values()),
            "identical_to_reference": sum(tally.identical.values()), "failure_codes": tally.codes,
            "per_phase": {phase: {"sent": tally.sent[phase], "failed": tally.failed[phase],
                                  "per_replica": dict(tally.by_replica.get(phase, {}))} for phase in tally.sent},
            "replicas": {replica: {"first": replica in first, "actors": sorted(roles),
                                   "actors_left_at_end": sorted(remaining.get(replica, ()))}
                         for replica, roles in timeline.replicas_seen.items()},
            "most_running": max((c["states"].get("RUNNING", 0) for c in timeline.changes), default=0),
            "timeline": timeline.changes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-fp32.yaml")
    parser.add_argument("--streams", type=int, default=6, help="clients at once in the high phase")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--low-requests", type=int, default=4)
    parser.add_argument("--min-on-new", type=int, default=6, help="requests the new replica answers before load falls")
    parser.add_argument("--target-ongoing", type=float, default=1.0, help="autoscaling_config.target_ongoing_requests")
    parser.add_argument("--downscale-delay-s", type=float, default=10.0)
    parser.add_argument("--phase-timeout-s", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args(argv)

    import ray
    from ray import serve

    from settings.config import APP_NAME

    args = engine_args(options.config, options.max_new_tokens, options.streams)
    expected = references(options.config, args, options.max_new_tokens)
    deployments = [autoscaling(options.target_ongoing, options.downscale_delay_s)]
    try:
        address, _ = start(args, deployments)
        result = run(address, APP_NAME, options, expected)
    finally:
        serve.shutdown()
        ray.shutdown()
    summary = {"config": options.config, "streams": options.streams, "max_new_tokens": options.max_new_tokens,
               "actor_cpus": args["verifier"]["actor"]["num_cpus"], "deployments": deployments, **result}
    print(json.dumps({k: v for k, v in summary.items() if k != "timeline"}, indent=1))
    if options.out:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(json.dumps(with_machine(summary), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
