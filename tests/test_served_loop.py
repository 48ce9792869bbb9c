"""The served engine loop (``server.engine_loop``, the default): one loop per replica steps every request
together through one call per actor per phase (``actors.executor``). A second application on the
shared tiny fp32 models with 2 running requests and 6 waiting: outputs equal the in-process engine's,
requests beyond the batch or the KV pool wait instead of failing, the queue's bound answers
RESOURCE_EXHAUSTED, and every state is released."""

from __future__ import annotations

import threading

import grpc
import pytest

from cluster.serve_client import Client, build_request
from serving_fixtures import (local_engine, loop_hold, own_app, ray_session, serving, tiny_args,  # noqa: F401
                              tiny_models, wait_until)
from test_serving import local_result

LOOP_APP = "specinfer-loop"
PROMPTS = ["def add(a, b):", "Hello wörld", "x = [i * i for i in range(10)]", "SELECT * FROM t WHERE",
           "The quick brown fox", "import os, sys", "while True: pass", "print('speculative')"]
RUNNING, WAITING = 2, 6
QUEUED_TOKENS = 16  # each of the eight requests that fill the batch and the queue


@pytest.fixture(scope="module")
def loop_app(serving, tiny_args):  # noqa: F811
    """The loop application; yields (gRPC address, Serve handle). Deleted at the end of the module.
    Its pool (896 tokens) holds two of the 8-stream or queue tests' requests, one 562-token one."""
    server = tiny_args["server"]
    args = {**tiny_args, "server": {**server, "max_concurrent_requests": RUNNING, "max_waiting_requests": WAITING,
                                    "batching": {**server["batching"], "kv_cache_tokens": 896}}}
    with own_app(serving, args, LOOP_APP, "/loop") as (_, handle, _):
        yield serving, handle


def held(handle) -> dict[str, int]:
    import ray

    actors = handle.actors.remote().result()
    return {"ingress": handle.num_active.remote().result(),
            **dict(zip(actors, ray.get([a.num_requests.remote() for a in actors.values()])))}


def run_streams(address: str, requests: list, stats: dict | None = None) -> tuple[dict[int, list[int]], list[str]]:
    """Each request on its own thread and channel, started together; (outputs, error statuses).
    ``stats``: filled with each request's final statistics."""
    outputs, errors, barrier = {}, [], threading.Barrier(len(requests))

    def one(index: int) -> None:
        with Client(address, LOOP_APP) as client:
            barrier.wait()
            try:
                chunks = list(client.stream(requests[index], timeout=600))
                outputs[index] = [t for chunk in chunks for t in chunk.token_ids]
                if stats is not None:
                    stats[index] = chunks[-1].stats
            except grpc.RpcError as error:
                errors.append(f"{error.code().name}: {error.details()}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    return outputs, errors


@pytest.mark.ray
def test_more_requests_than_the_batch_wait_and_equal_the_in_process_engine(loop_app, local_engine,
                                                                          tiny_args):  # noqa: F811
    address, handle = loop_app
    requests, stats = [build_request(p, max_new_tokens=40) for p in PROMPTS], {}
    outputs, errors = run_streams(address, requests, stats)
    assert errors == []
    expected = [local_result(local_engine, tiny_args, p, max_new_tokens=40)[1] for p in PROMPTS]
    assert [outputs[i] for i in range(len(PROMPTS))] == [list(result.token_ids) for result in expected]
    # the trees were drafted, merged and verified as in-process: the same acceptance, step for step
    assert [stats[i].accepted_tokens for i in range(len(PROMPTS))] == [r.stats.accepted_tokens for r in expected]
    assert sum(stats[i].accepted_tokens for i in range(len(PROMPTS))) > 0
    assert wait_until(lambda: not any(held(handle).values()), timeout_s=60), held(handle)


@pytest.mark.ray
def test_seeded_sampling_through_the_loop_equals_the_in_process_engine(loop_app, local_engine,
                                                                      tiny_args):  # noqa: F811
    address, _ = loop_app
    requests = [build_request(p, max_new_tokens=24, temperature=0.9, seed=11) for p in PROMPTS[:4]]
    outputs, errors = run_streams(address, requests)
    assert errors == []
    assert [outputs[i] for i in range(4)] == [
        list(local_result(local_engine, tiny_args, p, max_new_tokens=24, temperature=0.9, seed=11)[1].token_ids)
        for p in PROMPTS[:4]]


@pytest.mark.ray
def test_past_the_queue_a_request_is_refused_with_the_bound(loop_app, tmp_path):
    """Eight requests fill the batch and the queue (the verifier's loop calls held, so none ends, until
    the ingress counts all eight); the ninth gets RESOURCE_EXHAUSTED naming both settings; the eight
    then finish."""
    address, handle = loop_app
    verifier = handle.actors.remote().result()["verifier"]
    clients = [Client(address, LOOP_APP) for _ in range(RUNNING + WAITING)]
    try:
        with loop_hold(verifier, tmp_path):  # no verifier pass ends inside: all eight stay in flight
            calls = [c.stream(build_request(PROMPTS[i], max_new_tokens=QUEUED_TOKENS), timeout=600)
                     for i, c in enumerate(clients)]
            assert wait_until(lambda: handle.num_active.remote().result() == RUNNING + WAITING, timeout_s=60)
            with Client(address, LOOP_APP) as client, pytest.raises(grpc.RpcError) as refused:
                client.generate(build_request("one too many", max_new_tokens=4), timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.max_concurrent_requests + server.max_waiting_requests is 8" in refused.value.details()
        assert all(len([t for chunk in call for t in chunk.token_ids]) == QUEUED_TOKENS for call in calls)
    finally:
        for client in clients:
            client.close()
    assert wait_until(lambda: not any(held(handle).values()), timeout_s=60), held(handle)


@pytest.mark.parametrize("flag, expected", [(False, True), (True, False)])
def test_serve_flag_turns_the_engine_loop_off(flag, expected):
    """`specinfer serve --no-engine-loop`: the served config's engine section gets server.engine_loop
    false; without it the default (the engine loop) stands."""
    from pathlib import Path

    from cluster.cli_serve import load_serve_config
    from settings.config import EngineConfig, engine_section

    path = Path(__file__).resolve().parent.parent / "configs" / "serve.yaml"
    data = load_serve_config(path, no_engine_loop=flag)
    assert EngineConfig.model_validate(engine_section(data, path)).server.engine_loop is expected


@pytest.mark.ray
def test_a_request_the_pool_cannot_hold_beside_another_waits_for_its_blocks(loop_app, local_engine,
                                                                          tiny_args):  # noqa: F811
    """Two requests of 562 tokens each (110-token prompt, 400 new, a 52-node tree) in an 896-token
    pool: the second waits in the loop's queue, not failing, until the first gives its blocks back.
    They never share a verifier pass (each pass's items equal its count: one request a pass)."""
    import ray

    address, handle = loop_app
    verifier = handle.actors.remote().result()["verifier"]
    before = ray.get(verifier.loop_counters.remote())
    prompts = ["p" * 110, "q" * 110]
    outputs, errors = run_streams(address, [build_request(p, max_new_tokens=400) for p in prompts])
    assert errors == []
    assert [outputs[0], outputs[1]] == [
        list(local_result(local_engine, tiny_args, p, max_new_tokens=400)[1].token_ids) for p in prompts]
    after = ray.get(verifier.loop_counters.remote())
    assert after.items - before.items == after.forwards - before.forwards > 0, (before, after)
    assert wait_until(lambda: not any(held(handle).values()), timeout_s=60), held(handle)


class _Verifier:
    """A verifier's step_batch as the executor awaits it: records each call's ``released``."""

    def __init__(self):
        self.calls: list[tuple] = []

    @property
    def step_batch(self):
        return self

    def remote(self, merged, trees, prefills, released):
        self.calls.append(released)

        async def reply():
            from actors.loop_calls import StepReply
            return StepReply({}, (), (0, 8))
        return reply()


class _Group:
    names, neural, windows = ("ssm",), (True,), (None,)

    def __init__(self):
        self.verifier, self.detached = _Verifier(), []

    def release(self, key: str) -> None:
        self.detached.append(key)


class _Live:
    @staticmethod
    def usable(role: str) -> bool:
        return True


def test_a_released_request_rides_with_the_next_verify_call_ahead_of_admissions():
    """The executor counts a released request's blocks free at once, so the verifier must drop it
    before admitting another: its release goes in the next step_batch call (the detached release may
    arrive later), once."""
    from actors.executor import ActorExecutor
    from engine.requests import GenerationRequest
    from engine.step import run_sync

    group = _Group()
    executor = ActorExecutor(group, _Live(), capacity_tokens=128, block_size=16)
    assert executor.admit(0, GenerationRequest((1, 2, 3), 4), 100)
    assert not executor.admit(1, GenerationRequest((4, 5, 6), 4), 100)  # 7 + 7 blocks > 8: it waits
    key = executor.requests[0].key
    executor.release(0)
    assert executor.admit(1, GenerationRequest((4, 5, 6), 4), 100)
    run_sync(executor.verify(None, [], [1]))
    run_sync(executor.verify(None, [], []))
    assert group.verifier.calls == [(key,), ()] and group.detached == [key]
