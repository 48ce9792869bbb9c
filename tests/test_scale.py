"""Replicas that come and go: autoscaling, redeploys, and a replica whose actors do not fit.

The application ``specinfer-scale`` runs next to the shared one on the same tiny fp32 models, its
ingress deployment autoscaled by Serve between 1 and 2 replicas (``autoscaling_config`` given as a
Serve config's ``applications[].deployments[]`` gives it; ``bench.scale_out.autoscaling``: one
ongoing request per replica, short delays). Each replica owns its verifier, SSM and merge actors,
named ``<app>/<replica id>/<role>``. Tests run in file order: the load test leaves one replica,
which the redeploy test replaces. Nothing asserts speed: which replica answered (the response's
trailing metadata), outputs equal to the in-process engine's, errors none, actors alive or gone,
each wait bounded with a message.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from bench.load_faults import load_args
from bench.scale_out import INGRESS, autoscaling, replica_actors, replica_states
from cluster.serve_client import Client, answered_by, build_request
from serving_fixtures import (local_engine, loop_hold, own_app, ray_session, serving, tiny_args,  # noqa: F401
                              tiny_models, wait_until)
from test_serving import local_result

SCALE_APP = "specinfer-scale"
ROLES = {"verifier", "merge", "ssm/ssm-a", "ssm/ssm-b"}
PROMPTS = ["def add(a, b):", "Hello wörld", "The quick brown fox"]
NEW_TOKENS = 32
HELD = len(PROMPTS)  # streams frozen on a replica
BOUND_S = 300.0  # replicas start and stop on a shared 2-core machine: generous


def scale_args(tiny_args: dict, **server) -> dict:  # noqa: F811
    """Room for the held streams; a drain long enough for any hold (graceful_shutdown_timeout_s)."""
    args = load_args(tiny_args, 4)
    return {**args, "server": {**args["server"], "max_waiting_requests": 4, "drain_timeout_s": 300.0, **server}}


@pytest.fixture(scope="module")
def scale_app(serving, tiny_args):  # noqa: F811
    """The autoscaled application; yields its gRPC address. Deleted at the end of the module."""
    with own_app(serving, scale_args(tiny_args), SCALE_APP, "/scale", [autoscaling(1.0, 5.0)]):
        yield serving


def only_replica() -> str:
    """The one replica of the app (its id), once Serve has settled on one with all its actors."""
    settled = lambda: replica_states(SCALE_APP) == {"RUNNING": 1} and len(replica_actors(SCALE_APP)) == 1  # noqa: E731
    assert wait_until(settled, timeout_s=BOUND_S), (replica_states(SCALE_APP), replica_actors(SCALE_APP))
    (replica, roles), = replica_actors(SCALE_APP).items()
    assert roles == ROLES
    return replica


def replaced(old: str) -> bool:
    """The old replica is stopping and a new one runs with all its actors."""
    states, actors = replica_states(SCALE_APP), replica_actors(SCALE_APP)
    return states.get("STOPPING", 0) >= 1 and states.get("RUNNING", 0) >= 1 and \
        any(roles == ROLES for replica, roles in actors.items() if replica != old)


def admitted(count: int) -> bool:
    """The held streams are in: the only replica counts them, or Serve already added a replica for
    them (a handle call may then reach either replica)."""
    from ray import serve

    return len(replica_actors(SCALE_APP)) > 1 or serve.get_app_handle(SCALE_APP).num_active.remote().result() == count


def actor(replica: str, role: str):
    import ray

    name = f"{SCALE_APP}/{replica}/{role}"
    namespace = next(a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name)
    return ray.get_actor(name, namespace=namespace)


def start_streams(address: str, prompts: list[str]) -> tuple[list[threading.Thread], dict, list[str]]:
    """One stream per prompt, each on its own thread and channel: (threads, index -> (tokens,
    replica id), error statuses)."""
    outputs, errors = {}, []

    def one(index: int) -> None:
        with Client(address, SCALE_APP) as client:
            call = client.stream(build_request(prompts[index], max_new_tokens=NEW_TOKENS), timeout=900)
            try:
                outputs[index] = ([t for chunk in call for t in chunk.token_ids], _replica_id(answered_by(call)))
            except grpc.RpcError as error:
                errors.append(f"{error.code().name}: {error.details()}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    return threads, outputs, errors


@contextmanager
def held_streams(address: str, replica: str, tmp_path) -> Iterator[tuple[dict, list[str]]]:
    """One stream per prompt, admitted by ``replica`` and frozen there (its verifier's loop calls
    held) inside the block; let go and read to their ends at its end. Yields (outputs, errors) as
    ``start_streams`` fills them."""
    threads = []
    try:
        with loop_hold(actor(replica, "verifier"), tmp_path):
            threads, outputs, errors = start_streams(address, PROMPTS)
            assert wait_until(lambda: admitted(HELD), timeout_s=60), "the held streams were not admitted"
            yield outputs, errors
    finally:
        for thread in threads:
            thread.join(BOUND_S)
    assert not any(thread.is_alive() for thread in threads), "a stream did not end"


def ask(address: str, prompt: str) -> tuple[list[int], str]:
    """One unary request: (tokens, the replica id that answered)."""
    with Client(address, SCALE_APP) as client:
        reply, call = client.stub.Generate.with_call(build_request(prompt, max_new_tokens=NEW_TOKENS), timeout=600,
                                                     metadata=client.metadata)
    return list(reply.token_ids), _replica_id(answered_by(call))


def _replica_id(answered: str | None) -> str:
    app, _, replica = (answered or "/").partition("/")
    assert app == SCALE_APP, answered
    return replica


def expected(local_engine, tiny_args, prompt: str) -> list[int]:  # noqa: F811
    return list(local_result(local_engine, tiny_args, prompt, max_new_tokens=NEW_TOKENS)[1].token_ids)


@pytest.mark.ray
def test_load_adds_a_replica_that_serves_then_it_drains_and_goes(scale_app, local_engine, tiny_args,  # noqa: F811
                                                                  tmp_path):
    """Three streams held on the first replica (its verifier's loop calls frozen) are three ongoing
    requests, over the target of one: Serve starts a second replica with its own actors, and
    requests sent meanwhile are answered by it. Let go, the streams finish on the first replica;
    with no load Serve goes back to one replica, and the one that left has no actor left. No
    request fails and every output equals the in-process engine's."""
    address = scale_app
    first = only_replica()
    with held_streams(address, first, tmp_path) as (outputs, errors):
        two = lambda: replica_states(SCALE_APP).get("RUNNING") == 2 and len(replica_actors(SCALE_APP)) == 2  # noqa: E731
        assert wait_until(two, timeout_s=BOUND_S), (replica_states(SCALE_APP), replica_actors(SCALE_APP))
        (second, roles), = [(r, roles) for r, roles in replica_actors(SCALE_APP).items() if r != first]
        assert roles == ROLES  # its own actors, named apart from the first replica's
        answers = [ask(address, prompt) for prompt in PROMPTS]  # the first replica is busy and frozen
    assert errors == []
    assert outputs == {i: (expected(local_engine, tiny_args, p), first) for i, p in enumerate(PROMPTS)}
    assert [tokens for tokens, _ in answers] == [expected(local_engine, tiny_args, p) for p in PROMPTS]
    assert {replica for _, replica in answers} == {second}, answers
    survivor = only_replica()  # load gone: down to one replica
    gone = ({first, second} - {survivor}).pop()
    assert gone not in replica_actors(SCALE_APP)  # the replica that left took every actor with it
    assert ask(address, PROMPTS[0]) == (expected(local_engine, tiny_args, PROMPTS[0]), survivor)


@pytest.mark.ray
def test_redeploy_finishes_running_streams_on_the_old_replica(scale_app, local_engine, tiny_args,  # noqa: F811
                                                               tmp_path):
    """Streams held on the only replica while the application is redeployed with a changed config
    (serve.run, a new version): the old replica stops (Serve's graceful shutdown: no new requests,
    server.drain_timeout_s for the running ones) and they stay held until its replacement runs;
    let go, every stream ends complete and equal to the in-process engine's, the old replica's
    actors go, and the new replica answers. (With a drain shorter than the replacement's start,
    Serve kills the old replica under the streams and this fails.)"""
    from ray import serve

    from cluster.cli_serve import with_deployment_options
    from cluster.serve_app import app_builder

    address = scale_app
    old = only_replica()
    changed = with_deployment_options(app_builder(scale_args(tiny_args, request_ttl_s=599.0)), [autoscaling(1.0, 5.0)])
    # serve.run returns once the application runs, which is after the old replica has stopped
    redeploy = threading.Thread(target=serve.run, args=(changed,),
                                kwargs={"name": SCALE_APP, "route_prefix": "/scale", "blocking": False})
    with held_streams(address, old, tmp_path) as (outputs, errors):
        redeploy.start()
        # the old replica stops (drains) while a replacement starts and runs with its own actors
        assert wait_until(lambda: replaced(old) or old not in replica_actors(SCALE_APP), timeout_s=BOUND_S), \
            (replica_states(SCALE_APP), replica_actors(SCALE_APP))
        assert replica_actors(SCALE_APP).get(old) == ROLES, "the old replica went while its streams ran"
    redeploy.join(BOUND_S)
    assert not redeploy.is_alive(), "the redeploy did not finish"
    assert errors == []
    assert outputs == {i: (expected(local_engine, tiny_args, p), old) for i, p in enumerate(PROMPTS)}
    new = only_replica()
    assert new != old and old not in replica_actors(SCALE_APP)
    assert ask(address, PROMPTS[1]) == (expected(local_engine, tiny_args, PROMPTS[1]), new)


@pytest.mark.ray
def test_a_replica_whose_actors_do_not_fit_fails_its_start_with_the_reason(serving, tiny_args):  # noqa: F811
    """A verifier asking for 64 CPUs on the 4-CPU test node: the replica's start fails after
    server.actor_placement_timeout_s with what was missing (Serve's status shows it), instead of
    waiting forever, and leaves no actor behind."""
    from ray import serve

    from cluster.cli_serve import with_deployment_options
    from cluster.serve_app import app_builder

    name = "specinfer-unplaceable"
    args = {**tiny_args, "verifier": {"actor": {**tiny_args["verifier"]["actor"], "num_cpus": 64}},
            "server": {**tiny_args["server"], "actor_placement_timeout_s": 1.0}}
    app = with_deployment_options(app_builder(args), [{"name": INGRESS, "max_constructor_retry_count": 1}])
    try:
        with pytest.raises(RuntimeError, match="DEPLOY_FAILED|failed"):  # serve.run waits for RUNNING
            serve.run(app, name=name, route_prefix="/unplaceable", blocking=False)
        status = serve.status().applications[name]
        message = status.message + status.deployments[INGRESS].message
        assert status.status == "DEPLOY_FAILED", status
        assert "could not place its actors within 1 s (server.actor_placement_timeout_s)" in message, message
        assert "(verifier 64, ssm/ssm-a 0.25, ssm/ssm-b 0.25, merge 0.1)" in message, message
        assert "no node has 64 CPU for the verifier" in message, message
        assert replica_actors(name) == {}
    finally:
        serve.delete(name)


def test_shortage_names_each_actor_what_is_free_and_what_no_node_holds():
    from actors.placement import Demand, shortage

    demands = (Demand("verifier", 1.25, 1.0), Demand("ssm/a", 0.5, 0.0), Demand("merge", 0.0, 0.0))
    assert shortage(demands, {"CPU": 0.4}, [{"CPU": 2.0}, {"CPU": 2.0, "GPU": 0.5}]) == (
        "they need 1.75 CPU (verifier 1.25, ssm/a 0.5) and 1 GPU (verifier 1); the cluster has 0.4 of 4 CPU "
        "free and 0 of 0.5 GPU free; no node has 1 GPU for the verifier (the largest has 0.5)")


def test_replica_demands_follow_the_actor_options(tiny_args):  # noqa: F811
    """One bundle per actor, as the config asks; a tensor-parallel verifier only coordinates."""
    from actors.placement import Demand, replica_demands
    from settings.config import EngineConfig

    config = EngineConfig.model_validate(tiny_args)
    assert replica_demands(config) == (Demand("verifier", 0.25, 0.0), Demand("ssm/ssm-a", 0.25, 0.0),
                                       Demand("ssm/ssm-b", 0.25, 0.0), Demand("merge", 0.1, 0.0))
    tp = config.model_copy(update={"verifier": config.verifier.model_copy(update={"tensor_parallel_size": 2})})
    assert replica_demands(tp)[0] == Demand("verifier", 0.1, 0.0)
    assert Demand("merge", 0.0, 0.0).bundle() == {}


def test_deployment_options_come_from_the_serve_config_keys(tiny_args):  # noqa: F811
    """A Serve config's applications[].deployments[] entry sets the ingress's Serve options, as
    `serve run` and KubeRay apply them (`specinfer serve` too); an entry for another deployment
    is refused with both names."""
    from cluster.cli_serve import with_deployment_options
    from cluster.serve_app import app_builder

    app = with_deployment_options(app_builder(tiny_args), [autoscaling(1.0, 5.0)])
    config = app._bound_deployment._deployment_config
    assert (config.autoscaling_config.min_replicas, config.autoscaling_config.max_replicas,
            config.autoscaling_config.target_ongoing_requests) == (1, 2, 1.0)
    assert config.graceful_shutdown_timeout_s == 30.0  # the builder's drain stays (server.drain_timeout_s)
    auto = with_deployment_options(app_builder(tiny_args), [{"name": INGRESS, "num_replicas": "auto"}])
    assert auto._bound_deployment._deployment_config.autoscaling_config is not None
    with pytest.raises(ValueError, match="'Other', but the application's deployment is 'SpecInferIngress'"):
        with_deployment_options(app_builder(tiny_args), [{"name": "Other", "num_replicas": 2}])
