"""Load, cancellation, overload and drain on a second Serve application sized for 32 streams.

The application ``specinfer-load`` runs next to the shared one (tests/serving_fixtures.py) on the
same tiny fp32 models with ``server.max_concurrent_requests`` 32 and 48 threads per actor
(``bench.load_faults.load_args``). Its KV pool (12288 tokens) holds 32 requests of 128 new tokens
but not 32 of 400 (those wait in the engine loop's queue for blocks). Tests run in file order; the last one drains the application and deletes it.
Nothing here asserts speed: outputs, status codes, and state released within generous bounds.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from bench.load_faults import concurrency_for, load_args
from cluster.serve_client import Client, build_request
from serving_fixtures import (http_health, local_engine, loop_hold, own_app, ray_session, serving,  # noqa: F401
                              tiny_args, tiny_models)
from test_serving import LONG, local_result, wait_until

LOAD_APP = "specinfer-load"
STREAMS = 32
PROMPTS = ["def add(a, b):", "Hello wörld", "x = [i * i for i in range(10)]", "SELECT * FROM t WHERE",
           "The quick brown fox", "import os, sys", "while True: pass", "print('speculative')"]
RELEASE_FIGURE_S = 5.0  # the figure: states released within this long after a cancel
RELEASE_BOUND_S = 60.0  # what the tests assert (a shared 2-core machine may be slow)


@pytest.fixture(scope="module")
def load_app(serving, tiny_args):  # noqa: F811
    """The load application; yields (gRPC address, Serve handle). Deleted at the end of the module."""
    args = load_args(tiny_args, STREAMS)
    # The tree budget on: cost-aware trees choose their sizes for the batch's goodput against the
    # running requests' load (engine.budget.RunningLoad), chunked prefill of 16 tokens. The draft
    # gate off: every request drafts, so the cancels below meet drafting (the gate's choices are
    # tested on the loop in-process, tests/test_draft_gate.py).
    args["server"] = {**args["server"], "tree_budget": {"enabled": True, "draft_gate": False},
                      "batching": {**args["server"]["batching"], "kv_cache_tokens": 12288, "prefill_chunk_tokens": 16}}
    # Cost-aware shapes served (the verifier measures the verify-cost curve at start): the trees follow
    # timings and load, the tokens must not (each stream equals the in-process engine's fixed-shape output).
    args["speculation"] = {**args["speculation"], "policy": "cost"}
    with own_app(serving, args, LOAD_APP, "/load") as (_, handle, _):
        yield serving, handle


def held(handle) -> dict[str, int]:
    import ray

    actors = handle.actors.remote().result()
    return {"ingress": handle.num_active.remote().result(),
            **dict(zip(actors, ray.get([a.num_requests.remote() for a in actors.values()])))}


def settled(handle) -> bool:
    """No request held anywhere and every paged pool back to its total."""
    import ray

    actors = handle.actors.remote().result()
    pools = ray.get([a.pool_blocks.remote() for name, a in actors.items() if name != "merge"])
    return not any(held(handle).values()) and all(free == unreserved == total for free, unreserved, total in pools)


def test_actor_threads_fit_32_streams(tiny_args):  # noqa: F811
    from settings.config import EngineConfig

    assert concurrency_for(STREAMS) == 48
    config = EngineConfig.model_validate(load_args(tiny_args, STREAMS))
    assert config.server.max_concurrent_requests == 32 and config.verifier.actor.max_concurrency == 48
    too_few = {**tiny_args, "server": {**tiny_args["server"], "max_concurrent_requests": 9}}  # actors have 8
    with pytest.raises(ValueError, match="max_concurrency"):
        EngineConfig.model_validate(too_few)


@pytest.mark.ray
def test_32_streams_equal_each_alone_and_return_their_blocks(load_app, local_engine, tiny_args):  # noqa: F811
    address, handle = load_app
    expected = {p: list(local_result(local_engine, tiny_args, p, max_new_tokens=128)[1].token_ids) for p in PROMPTS}
    outputs: dict[int, list[int]] = {}
    errors: list[str] = []
    barrier = threading.Barrier(STREAMS)

    def one(index: int) -> None:
        with Client(address, LOAD_APP) as client:
            barrier.wait()
            try:
                call = client.stream(build_request(PROMPTS[index % len(PROMPTS)], max_new_tokens=128), timeout=600)
                outputs[index] = [t for chunk in call for t in chunk.token_ids]
            except grpc.RpcError as error:
                errors.append(f"{error.code().name}: {error.details()}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    assert errors == []
    assert all(outputs[i] == expected[PROMPTS[i % len(PROMPTS)]] for i in range(STREAMS))
    assert wait_until(lambda: settled(handle), timeout_s=RELEASE_BOUND_S), held(handle)


CANCEL_SEED, CANCEL_ROUNDS, PER_ROUND = 16, 6, 4  # 24 cancels


def cancel_schedule() -> list[list[tuple[int, float, bool]]]:
    """Per round, per stream: (chunks read before the cancel, extra delay in s, disconnect instead).

    At least 2 chunks: the second comes from a verify step, so the request has certainly drafted
    (an SSM records a draft before answering) when it is cancelled."""
    rng = random.Random(CANCEL_SEED)
    return [[(rng.randint(2, 8), rng.uniform(0.0, 0.05), rng.random() < 0.5) for _ in range(PER_ROUND)]
            for _ in range(CANCEL_ROUNDS)]


def cancel_round(address: str, plan: list[tuple[int, float, bool]]) -> float:
    """Open one stream per plan entry, cancel each (or close its channel) at its point; returns the
    time of the last cancel."""
    cancelled: list[float] = []

    def one(index: int) -> None:
        chunks, delay, disconnect = plan[index]
        client = Client(address, LOAD_APP)
        call = client.stream(build_request(PROMPTS[index], max_new_tokens=LONG), timeout=120)
        for _ in range(chunks):
            next(call)
        time.sleep(delay)
        client.close() if disconnect else call.cancel()
        cancelled.append(time.monotonic())
        client.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(plan))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(cancelled) == len(plan)
    return max(cancelled)


@pytest.mark.ray
def test_random_cancels_and_disconnects_release_every_state(load_app):
    """A seeded schedule of cancels and channel closes at random points: each round's states are all
    released within the bound. Cancels that reach Serve's proxy while it hands a chunk to gRPC are
    passed on by cluster.grpc_proxy (tests/test_grpc_proxy.py); the figure counts the rounds
    released within RELEASE_FIGURE_S and the most drafts a cancelled request made."""
    import ray

    address, handle = load_app
    ssm = handle.actors.remote().result()["ssm/ssm-a"]
    before = {t.request_id for t in ray.get(ssm.draft_timings.remote())}
    within, waits = 0, []
    for plan in cancel_schedule():
        last = cancel_round(address, plan)
        assert wait_until(lambda: settled(handle), timeout_s=RELEASE_BOUND_S, poll_s=0.05), held(handle)
        waits.append(time.monotonic() - last)
        within += len(plan) if waits[-1] <= RELEASE_FIGURE_S else 0
    drafts: dict[str, int] = {}
    for timing in ray.get(ssm.draft_timings.remote()):
        if timing.request_id not in before:
            drafts[timing.request_id] = drafts.get(timing.request_id, 0) + 1
    print(f"cancels sent {CANCEL_ROUNDS * PER_ROUND}, released within {RELEASE_FIGURE_S:g} s: {within}; "
          f"waits {[round(w, 2) for w in waits]}; most drafts of a cancelled request {max(drafts.values())}")
    assert len(drafts) == CANCEL_ROUNDS * PER_ROUND, drafts


@pytest.mark.ray
def test_overload_beyond_admission_and_deadlines_under_load(load_app, tmp_path):
    """Every verifier pass is frozen (the engine loop's calls held), and streams are opened up to
    server.max_concurrent_requests (this app queues none: max_waiting_requests 0): the next request
    gets RESOURCE_EXHAUSTED naming the bound, one admitted with a short deadline ends
    DEADLINE_EXCEEDED, and after the freeze is lifted the actors live on and every state is released."""
    address, handle = load_app
    verifier = handle.actors.remote().result()["verifier"]
    with Client(address, LOAD_APP) as client:
        calls = []
        try:
            with loop_hold(verifier, tmp_path):  # no pass ends until the hold is lifted
                calls = [client.stream(build_request(PROMPTS[i % len(PROMPTS)] + str(i), max_new_tokens=LONG),
                                       timeout=300) for i in range(STREAMS)]
                assert wait_until(lambda: handle.num_active.remote().result() == STREAMS, timeout_s=60)
                with pytest.raises(grpc.RpcError) as refused:
                    client.generate(build_request("over the limit", max_new_tokens=LONG), timeout=60)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert f"server.max_concurrent_requests + server.max_waiting_requests is {STREAMS}" in \
                    refused.value.details()
                calls.pop().cancel()  # a place for the request with a deadline
                assert wait_until(lambda: handle.num_active.remote().result() == STREAMS - 1, timeout_s=60)
                with pytest.raises(grpc.RpcError) as caught:
                    client.generate(build_request("deadline", max_new_tokens=LONG), timeout=0.5)
                assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            for call in calls:
                call.cancel()
        assert wait_until(lambda: settled(handle), timeout_s=RELEASE_BOUND_S), held(handle)
        assert client.generate(build_request("alive", max_new_tokens=4), timeout=60).stats.new_tokens == 4


@pytest.mark.ray
def test_drain_finishes_running_streams_and_refuses_new_ones(load_app, local_engine, tiny_args,  # noqa: F811
                                                              tmp_path):
    """The stream is frozen before it starts (the verifier's loop calls held), so the drain
    certainly starts while it runs; new requests get UNAVAILABLE and health says NOT_SERVING (HTTP
    503 "draining") while Serve's replica check still passes; the stream, let go, completes with
    all its tokens and the drain returns 0 requests left. Runs last: it drains."""
    from ray.serve.context import _get_global_client

    address, handle = load_app
    expected = list(local_result(local_engine, tiny_args, PROMPTS[0], max_new_tokens=LONG)[1].token_ids)
    verifier = handle.actors.remote().result()["verifier"]
    http = _get_global_client().http_config
    with Client(address, LOAD_APP) as client:
        with loop_hold(verifier, tmp_path):
            call = client.stream(build_request(PROMPTS[0], max_new_tokens=LONG), timeout=300)
            assert wait_until(lambda: handle.num_active.remote().result() == 1, timeout_s=60)  # admitted, frozen
            drained = handle.drain.remote(120.0)
            assert wait_until(lambda: _refused(client), timeout_s=60)
            assert client.health_status() == "NOT_SERVING"
            assert http_health(f"http://{http.host}:{http.port}/load/health") == (503, "draining")
            handle.check_health.remote().result()  # a drain is no reason to replace the replica
        tokens = [t for chunk in call for t in chunk.token_ids]
    assert tokens == expected
    assert drained.result(timeout_s=180) == 0
    assert wait_until(lambda: settled(handle), timeout_s=RELEASE_BOUND_S), held(handle)


def _refused(client: Client) -> bool:
    """A new request is answered UNAVAILABLE by the draining replica. The request is invalid, so
    before the drain it is refused (INVALID_ARGUMENT) without reaching a model: admission comes
    first, so a draining replica answers UNAVAILABLE."""
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(build_request("new", max_new_tokens=0), timeout=30)
    return caught.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in caught.value.details()
