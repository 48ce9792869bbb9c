"""Faults: model actors killed mid-request, and health that tells the truth.

A dedicated Serve application (``specinfer-faults``, route prefix ``/faults``) next to the shared
one, so the kills here never disturb other modules; it is deleted at the end. Every output is
checked against the in-process engine in fp32 (greedy: the target's own output). Waits poll a
condition until a generous deadline. A kill certainly lands inside a request: the verifier's
forwards are frozen (``hold_next_batch``) while the actor is killed, so the stream cannot end
first; afterwards the test checks that the ingress saw the failure (``recoveries``).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from pathlib import Path

import grpc
import pytest

from cluster.serve_client import Client, build_request
from serving_fixtures import (http_health, local_engine, loop_hold, own_app, ray_session,  # noqa: F401
                              serving, tiny_args, tiny_models, wait_until)

APP = "specinfer-faults"
PROMPT = "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)"
LONG = 400  # new tokens: a request runs for 100+ steps, far longer than a kill takes to land
SHORT = 32  # new tokens of a request that only shows an actor used again (greedy: LONG's first SHORT)
RECOVERY_BOUND_S = 300.0  # a hang guard while polling for a recovery, not a speed bound
HEALTH = {"probe_timeout_s": 1.0, "retry_interval_s": 0.5, "unhealthy_after_s": 120.0}


# --- helpers ----------------------------------------------------------------------------


def reference(engine, args: dict, prompt: str, max_new_tokens: int) -> list[int]:
    """The in-process engine's greedy ids for the request (the served config's speculation)."""
    from cluster.build import speculation_options
    from engine.requests import GenerationRequest
    from settings.config import EngineConfig

    options = speculation_options(EngineConfig.model_validate(args))
    ids = tuple(engine.tokenizer.encode(prompt))
    return list(engine.generate(GenerationRequest(ids, max_new_tokens, speculation=options)).token_ids)


def kill(handle) -> None:
    """Kill the actor's process; Ray restarts it (max_restarts -1)."""
    import ray

    ray.kill(handle, no_restart=False)


def kill_mid_stream(app, role: str, tmp_dir) -> None:
    """Kill ``role`` while every running stream is frozen before its next target pass (the
    verifier's engine-loop calls held), so none can finish before the kill lands; then let them go
    on (a killed verifier takes its hold with it)."""
    actors = app.actors.remote().result()
    with loop_hold(actors["verifier"], tmp_dir):
        kill(actors[role])


def draft_count(app, role: str) -> int:
    import ray

    return len(ray.get(app.actors.remote().result()[role].draft_timings.remote(), timeout=30))


def recoveries(app, role: str) -> int:
    return sum(1 for r in app.recoveries.remote().result() if r.role == role)


# --- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def faults_app(serving, tiny_args):  # noqa: F811
    """(gRPC client, Serve handle, HTTP health URL) of an application only this module uses."""
    args = {**tiny_args, "server": {**tiny_args["server"], "health": HEALTH}}
    with own_app(serving, args, APP, "/faults") as (client, handle, base_url):
        yield client, handle, f"{base_url}/health"


@pytest.fixture(scope="module")
def expected(local_engine, tiny_args):  # noqa: F811
    return reference(local_engine, tiny_args, PROMPT, LONG)


# --- without Ray: the liveness logic ------------------------------------------------------


class FakeActor:
    """An actor handle whose ``ping`` answers, hangs (restarting) or fails (dead) on demand (it has no
    ``ready``: probes must not fetch what ``ready`` returns, the verifier's tokenizer)."""

    def __init__(self, actor_id: str):
        self.state, outer = "up", self
        self.contexts: list[contextvars.Context] = []  # the context each ``ping`` call was sent from

        class _Id:
            def hex(self):
                return actor_id

        class _Ping:
            def remote(self):
                outer.contexts.append(contextvars.copy_context())

                async def answer():
                    if outer.state == "restarting":
                        await asyncio.sleep(3600)
                    return None
                return answer()

        self._actor_id, self.ping = _Id(), _Ping()


async def until(condition, timeout_s: float = 30.0) -> None:
    """Yield to the event loop until ``condition()`` holds (background probes run meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_liveness_marks_probes_and_reports():
    from ray.exceptions import RayActorError

    from actors.liveness import Liveness

    now = [0.0]
    actors = {"verifier": FakeActor("v"), "ssm/a": FakeActor("a")}
    liveness = Liveness(actors, probe_timeout_s=0.05, retry_interval_s=2.0, cache_s=1.0, clock=lambda: now[0])

    async def scenario():
        assert (await liveness.report()).serving
        error = RayActorError()
        error.actor_id = "a"
        assert liveness.role_of(error) == "ssm/a"
        actors["ssm/a"].state = "restarting"
        liveness.failed("ssm/a")
        assert not liveness.usable("ssm/a")  # starts a background probe: it hangs
        await asyncio.sleep(0.2)
        assert not liveness.usable("ssm/a") and liveness.recoveries == []
        assert (await liveness.report()).serving  # cached for cache_s
        now[0] = 1.5
        report = await liveness.report()
        assert not report.serving and report.down == ("ssm/a",)
        now[0] = 3.0
        assert (await liveness.report()).unhealthy_for_s == 1.5
        actors["ssm/a"].state = "up"
        assert not liveness.usable("ssm/a")  # a probe is due: it answers in the background
        await until(lambda: liveness.recoveries)
        assert liveness.usable("ssm/a") and [r.role for r in liveness.recoveries] == ["ssm/a"]
        now[0] = 4.5
        assert await liveness.report() == type(report)(True, (), 0.0)

    asyncio.run(scenario())


CALLER_TASK = contextvars.ContextVar("caller_task")  # stands in for Ray's: whose child a call is


def test_probes_are_sent_outside_the_callers_context():
    """Ray makes a call the child of the task whose context sends it and cancels it with that task:
    a probe started by a request or a health call whose client goes away must not be its child."""
    from actors.liveness import Liveness

    actor = FakeActor("a")
    liveness = Liveness({"ssm/a": actor}, probe_timeout_s=1.0, retry_interval_s=0.0, cache_s=0.0)

    async def scenario():
        CALLER_TASK.set("request")
        liveness.failed("ssm/a")
        assert not liveness.usable("ssm/a")  # a probe in the background
        await until(lambda: liveness.recoveries)
        assert (await liveness.report()).serving  # a health round
        assert CALLER_TASK.get() == "request"

    asyncio.run(scenario())
    assert len(actor.contexts) == 2 and all(CALLER_TASK not in context for context in actor.contexts)


# --- served ----------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.parametrize("role", ["ssm/ssm-a", "merge"])
def test_killed_ssm_or_merge_mid_stream_is_survived_and_used_again(faults_app, expected, role, tmp_path):
    """Twice in a row: the stream ends with the reference tokens and no error; the ingress records
    the actor's failure and recovery, and it drafts (SSM) or merges (the next request's tokens are
    right) again. (Issue 16's "used again within 30 s" is a speed figure, not asserted here.)"""
    client, app, _ = faults_app
    for round_ in range(2):
        before = recoveries(app, role)
        call = client.stream(build_request(PROMPT, max_new_tokens=LONG), timeout=300)
        ids = list(next(call).token_ids)
        kill_mid_stream(app, role, tmp_path)
        ids += [t for chunk in call for t in chunk.token_ids]
        assert ids == expected, f"round {round_}"
        assert wait_until(lambda: recoveries(app, role) > before, RECOVERY_BOUND_S), \
            f"round {round_}: the ingress never recorded {role} failing and answering again"
        drafts = draft_count(app, "ssm/ssm-a")
        reply = client.generate(build_request(PROMPT, max_new_tokens=SHORT), timeout=300)
        assert list(reply.token_ids) == expected[:SHORT] and len(expected) > SHORT
        assert draft_count(app, "ssm/ssm-a") > drafts  # the SSM drafts again (after a restart too)


@pytest.mark.ray
def test_killed_verifier_fails_in_flight_fast_then_serves(faults_app, local_engine, tiny_args,  # noqa: F811
                                                          tmp_path):
    """The in-flight stream fails UNAVAILABLE: by the dead actor (RayActorError / StateLost), not
    its 300 s deadline (that would be DEADLINE_EXCEEDED); health comes back, the ingress records
    the verifier's recovery, and the rebuilt verifier serves the reference tokens."""
    client, app, health_url = faults_app
    before = recoveries(app, "verifier")
    call = client.stream(build_request(PROMPT, max_new_tokens=LONG), timeout=300)
    next(call)
    kill_mid_stream(app, "verifier", tmp_path)
    with pytest.raises(grpc.RpcError) as failure:
        for _ in call:
            pass
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, failure.value.details()
    assert wait_until(lambda: client.serving() and http_health(health_url)[0] == 200, RECOVERY_BOUND_S, poll_s=0.5)
    assert recoveries(app, "verifier") > before
    reply = client.generate(build_request("after the rebuild", max_new_tokens=24), timeout=300)
    assert list(reply.token_ids) == reference(local_engine, tiny_args, "after the rebuild", 24)


def occupy(ssm, count: int, release: Path) -> list:
    """``count`` calls that hold SSM threads (``__ray_call__``) until ``release`` exists (at most
    300 s): with every thread of its max_concurrency held, its ``ping`` waits, as while it restarts."""

    def hold(actor, path: str) -> None:  # local: Ray pickles it by value
        import os
        import time

        deadline = time.monotonic() + 300
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)

    return [ssm.__ray_call__.remote(hold, str(release)) for _ in range(count)]


@pytest.mark.ray
def test_health_not_serving_while_an_actor_is_down(faults_app, tiny_args, tmp_path):
    """NOT_SERVING / 503 while an SSM does not answer (its threads held by the test, so the window
    stays open until both are seen: no race with a restart), then, killed and restarted, SERVING /
    200; Serve's check_health keeps passing (down far less than unhealthy_after_s)."""
    client, app, health_url = faults_app
    assert client.serving() and http_health(health_url)[0] == 200
    ssm, release = app.actors.remote().result()["ssm/ssm-b"], tmp_path / "release"
    seen: set[str] = set()

    def both_seen() -> bool:
        seen.update({"NOT_SERVING"} if not client.serving() else set())
        seen.update({"503"} if http_health(health_url)[0] == 503 else set())
        return seen == {"NOT_SERVING", "503"}

    try:
        occupy(ssm, tiny_args["server"]["ssm_actor"]["max_concurrency"], release)
        assert wait_until(both_seen, RECOVERY_BOUND_S, poll_s=0.2), f"health answered only {seen or 'OK'}"
        kill(ssm)  # the held calls end with its process
    finally:
        release.touch()
    assert wait_until(lambda: client.serving() and http_health(health_url)[0] == 200, RECOVERY_BOUND_S, poll_s=0.5)
    app.check_health.remote().result()
