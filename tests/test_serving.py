"""Distributed serving: the Ray Serve gRPC app over SSM / merge / verifier actors.

The Ray tests share one local Ray + Serve instance (127.0.0.1, capped object store) serving tiny
random fp32 models; every served output is checked against the in-process engine on the same
config, and greedy output against the target's own ``generate``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from cluster.serve_client import Client, build_request
from protos import specinfer_pb2 as pb
from serving_fixtures import (ingress, local_engine, loop_hold, ray_session, serving, tiny_args,  # noqa: F401
                              tiny_models, wait_until)

SERVE_YAML = Path(__file__).resolve().parent.parent / "configs" / "serve.yaml"
PROMPTS = ["Hello wörld, speculative decoding!", "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)"]
LONG = 400  # max_new_tokens that keeps a request busy for seconds


# --- helpers ----------------------------------------------------------------------------


def local_result(engine, config_args, prompt=None, messages=(), max_new_tokens=24, temperature=0.0, top_p=1.0,
                 top_k=0, seed=None, stop=(), **speculation):
    """The in-process engine's answer to the request the server gets."""
    from cluster.build import speculation_options
    from settings.config import EngineConfig
    from engine.requests import GenerationRequest, SpeculationOptions
    from engine.sampling import SamplingParams

    tok = engine.tokenizer
    if prompt is not None:
        ids = tok.encode(prompt)
    else:
        text = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    options = speculation_options(EngineConfig.model_validate(config_args))
    if speculation:
        options = SpeculationOptions(**{**options.__dict__, **speculation})
    request = GenerationRequest(tuple(ids), max_new_tokens, SamplingParams(temperature, top_k, top_p, seed), options,
                                tuple(stop))
    return ids, engine.generate(request)


def held_requests(ingress) -> dict[str, int]:  # noqa: F811
    """Per-request state held anywhere: ingress admissions and each actor's request count."""
    import ray

    actors = ingress.actors.remote().result()
    counts = dict(zip(actors, ray.get([a.num_requests.remote() for a in actors.values()])))
    return {"ingress": ingress.num_active.remote().result(), **counts}


def nothing_held(ingress) -> bool:  # noqa: F811
    return not any(held_requests(ingress).values())


def open_stream(client: Client, prompt: str, max_new_tokens: int = LONG):
    """Start a long streaming request and read its first chunk (so it was admitted)."""
    call = client.stream(build_request(prompt, max_new_tokens=max_new_tokens), timeout=120)
    first = next(call)
    return call, first


# --- without Ray --------------------------------------------------------------------------


def test_grpc_stubs_are_fresh():
    from protos.codegen import stale_files

    assert stale_files() == [], "run: python -m protos.codegen"


@pytest.mark.parametrize("defaults,field", [({"temperature": 1e-4}, "temperature"), ({"top_p": 1e-9}, "top_p")])
def test_defaults_no_request_could_use_are_refused_at_start(tiny_args, defaults, field):
    """The config's sampling defaults obey the same bounds as a request's (a tiny temperature
    would make every request that leaves it unset fail, blamed on the client)."""
    from cluster.serve_app import app_builder

    args = {**tiny_args, "defaults": {**tiny_args.get("defaults", {}), **defaults}}
    with pytest.raises(ValueError, match=f"defaults.{field}"):
        app_builder(args)


def test_serve_config_is_accepted_by_serve_and_engine():
    from ray.serve.schema import ServeDeploySchema

    from cluster.cli_serve import _import_attr, load_serve_config
    from settings.config import APP_NAME, load_config

    data = load_serve_config(SERVE_YAML)
    schema = ServeDeploySchema.model_validate(data)
    assert schema.grpc_options.port == 9000 and data["http_options"]["host"] == "127.0.0.1"
    for path in schema.grpc_options.grpc_servicer_functions:
        assert callable(_import_attr(path))
    app = next(a for a in schema.applications if a.name == APP_NAME)
    config = load_config(SERVE_YAML)
    assert _import_attr(app.import_path)(app.args) is not None  # builds the app; loads nothing
    assert config.target.name and config.server.max_concurrent_requests >= 1


def test_request_store_ttl_and_release():
    from actors.store import RequestStore

    now = [0.0]
    store = RequestStore(ttl_s=10.0, clock=lambda: now[0])
    assert store.get_or_create("a", lambda: "state-a") == "state-a"
    assert store.put("b", "state-b") and len(store) == 2
    now[0] = 5.0
    assert store.get("a") == "state-a"  # touching refreshes the idle clock
    now[0] = 12.0
    assert store.sweep() == ["b"] and len(store) == 1
    assert store.get_or_create("b", lambda: "again") is None  # expired ids stay dead
    assert store.release("a") and not store.release("a")
    assert store.get_or_create("a", lambda: "late") is None and not store.put("a", "late")
    assert store.was_released("a") and len(store) == 0


def test_request_store_put_over_a_held_state_drops_the_old_one():
    from actors.store import RequestStore

    dropped: list[str] = []
    store = RequestStore(ttl_s=10.0, on_drop=dropped.append)
    assert store.put("a", "first") and store.put("a", "first")  # the same state again: kept
    assert dropped == []
    assert store.put("a", "second") and dropped == ["first"] and store.get("a") == "second"
    assert store.release("a") and dropped == ["first", "second"]


def test_sweeper_thread_expires_idle_state():
    from actors.store import RequestStore, start_sweeper

    store = RequestStore(ttl_s=0.05)
    store.put("idle", object())
    stop = start_sweeper(store, interval_s=0.05)
    try:
        assert wait_until(lambda: len(store) == 0, timeout_s=5.0)
    finally:
        stop.set()


# --- served output equals the in-process engine ---------------------------------------------


@pytest.mark.ray
def test_local_ray_is_bound_to_loopback(ray_session, serving):
    import ray

    if not ray_session:
        pytest.skip("Ray was started by another test module")
    assert [node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]] == ["127.0.0.1"]
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")


@pytest.mark.ray
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_unary_and_stream_match_engine_and_target(serving, local_engine, tiny_args, prompt):
    ids, expected = local_result(local_engine, tiny_args, prompt, max_new_tokens=40)
    model = local_engine.target.model
    reference = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=40)[0, len(ids):].tolist()
    assert list(expected.token_ids) == reference
    with Client(serving) as client:
        unary = client.generate(build_request(prompt, max_new_tokens=40), timeout=60)
        chunks = list(client.stream(build_request(prompt, max_new_tokens=40), timeout=60))
    assert list(unary.token_ids) == reference and unary.text == expected.text
    assert unary.finish_reason == pb.FINISH_REASON_LENGTH
    assert unary.stats.new_tokens == 40 and unary.stats.target_steps == expected.stats.target_steps
    assert dict(unary.stats.accepted_per_ssm) == expected.stats.accepted_per_proposer
    assert [t for c in chunks for t in c.token_ids] == reference
    assert "".join(c.text for c in chunks) == expected.text
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH and chunks[-1].stats.new_tokens == 40


@pytest.mark.ray
def test_chat_messages_and_stop_string(serving, local_engine, tiny_args):
    messages = [("system", "Be brief."), ("user", "Name three colours.")]
    _, plain = local_result(local_engine, tiny_args, messages=messages, max_new_tokens=40)
    stop = plain.text[12:14]  # a string the output really contains
    _, expected = local_result(local_engine, tiny_args, messages=messages, max_new_tokens=40, stop=[stop])
    assert expected.finish_reason == "stop"
    request = build_request(messages=messages, max_new_tokens=40, stop=[stop])
    with Client(serving) as client:
        unary = client.generate(request, timeout=60)
        chunks = list(client.stream(request, timeout=60))
    assert unary.text == expected.text and unary.finish_reason == pb.FINISH_REASON_STOP
    assert list(unary.token_ids) == list(expected.token_ids)
    shown = ""
    for chunk in chunks:  # streamed text only grows, and never shows text that is cut later
        shown += chunk.text
        assert expected.text.startswith(shown)
    assert shown == expected.text and chunks[-1].finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.ray
@pytest.mark.parametrize("speculation", [
    {"mode": "incremental"},
    {"mode": "sequence", "sequence_depth": 3},
    {"mode": "tree", "expansion": (3, 1), "proposers": ("ssm-a", "suffix")},
])
def test_speculation_options_match_engine(serving, local_engine, tiny_args, speculation):
    prompt = PROMPTS[1]
    _, expected = local_result(local_engine, tiny_args, prompt, max_new_tokens=20, **speculation)
    request = build_request(prompt, max_new_tokens=20, mode=speculation["mode"],
                            sequence_depth=speculation.get("sequence_depth"),
                            expansion=speculation.get("expansion", ()), ssms=speculation.get("proposers", ()))
    with Client(serving) as client:
        reply = client.generate(request, timeout=60)
    assert list(reply.token_ids) == list(expected.token_ids)
    assert reply.stats.target_steps == expected.stats.target_steps and reply.stats.mode == speculation["mode"]


@pytest.mark.ray
@pytest.mark.parametrize("children", ["top_k", "sampled_without_replacement"])
def test_seeded_sampling_matches_in_process(serving, local_engine, tiny_args, children):
    sampling = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "seed": 1234}
    _, expected = local_result(local_engine, tiny_args, PROMPTS[0], max_new_tokens=30, children=children,
                               **sampling)
    request = build_request(PROMPTS[0], max_new_tokens=30, children=children, **sampling)
    with Client(serving) as client:
        first = client.generate(request, timeout=60)
        again = client.generate_streamed(request, timeout=60)
    assert list(first.token_ids) == list(expected.token_ids) == list(again.token_ids)


@pytest.mark.ray
def test_concurrent_requests_equal_each_alone(serving, local_engine, tiny_args):
    expected = [local_result(local_engine, tiny_args, p, max_new_tokens=48)[1] for p in PROMPTS]
    results: dict[int, pb.GenerateResponse] = {}

    def ask(index: int) -> None:
        with Client(serving) as client:
            results[index] = client.generate(build_request(PROMPTS[index], max_new_tokens=48), timeout=90)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [list(results[i].token_ids) for i in range(len(PROMPTS))] == [list(e.token_ids) for e in expected]


# --- errors, load, cancellation ---------------------------------------------------------


BAD_REQUESTS = {
    "empty prompt": ({"prompt": ""}, "prompt"),
    "prompt and messages": ({"prompt": "hi", "messages": [("user", "hi")]}, "prompt"),
    "prompt over context": ({"prompt": "x" * 600}, "prompt"),
    "max_new_tokens 0": ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    "max_new_tokens over limit": ({"prompt": "hi", "max_new_tokens": 401}, "max_new_tokens"),
    "negative temperature": ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    "top_p 0": ({"prompt": "hi", "top_p": 0.0}, "top_p"),
    "top_p over 1": ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    "negative top_k": ({"prompt": "hi", "top_k": -1}, "top_k"),
    "unknown SSM": ({"prompt": "hi", "ssms": ["nope"]}, "speculation.ssms"),
    "zero width": ({"prompt": "hi", "expansion": [2, 0]}, "speculation.expansion"),
    "schedule too deep": ({"prompt": "hi", "expansion": [1] * 33}, "speculation.expansion"),
    "sequence without SSM": ({"prompt": "hi", "mode": "sequence", "ssms": ["suffix"]}, "speculation"),
}


@pytest.mark.ray
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_bad_inputs_are_invalid_argument(serving, stream):
    with Client(serving) as client:
        for name, (fields, field) in BAD_REQUESTS.items():
            fields = dict(fields)
            request = build_request(fields.pop("prompt", None), fields.pop("messages", ()), **fields)
            with pytest.raises(grpc.RpcError) as caught:
                if stream:
                    list(client.stream(request, timeout=30))
                else:
                    client.generate(request, timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert caught.value.details().startswith(f"{field}:"), (name, caught.value.details())
        assert client.generate(build_request("still serving", max_new_tokens=4), timeout=30).stats.new_tokens == 4


@pytest.mark.ray
def test_overload_is_resource_exhausted(serving, ingress):  # noqa: F811
    with Client(serving) as client:
        calls = [open_stream(client, p)[0] for p in PROMPTS]  # max_concurrent_requests is 2
        try:
            with pytest.raises(grpc.RpcError) as caught:
                client.generate(build_request("one too many", max_new_tokens=4), timeout=30)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_concurrent_requests" in caught.value.details()
        finally:
            for call in calls:
                call.cancel()
        assert wait_until(lambda: nothing_held(ingress), timeout_s=30), held_requests(ingress)
        assert client.generate(build_request("admitted again", max_new_tokens=4), timeout=30).stats.new_tokens == 4


# A cancel must stop the request long before its end (fewer than LONG // 4 drafts). Serve 2.60's
# proxy would lose a cancel that arrives while it hands a chunk to gRPC; cluster.grpc_proxy passes
# those on (tests/test_grpc_proxy.py, figure in tests/test_load.py). The attempts are a margin for
# a machine so slow that many steps run between the cancel and its arrival.
CANCEL_ATTEMPTS = 3


@pytest.mark.ray
def test_cancelled_stream_stops_and_releases_state(serving, ingress):  # noqa: F811
    import ray

    ssm = ingress.actors.remote().result()["ssm/ssm-a"]
    for _ in range(CANCEL_ATTEMPTS):
        before = {t.request_id for t in ray.get(ssm.draft_timings.remote())}
        with Client(serving) as client:
            call, _ = open_stream(client, PROMPTS[0])
            next(call)
            call.cancel()
        assert wait_until(lambda: nothing_held(ingress), timeout_s=30), held_requests(ingress)
        released = time.time()  # every actor has dropped it (draft timings use this clock: time.time())
        (cancelled,) = {t.request_id for t in ray.get(ssm.draft_timings.remote())} - before
        with Client(serving) as client:  # drafted through the same SSM after the release
            assert client.generate(build_request("after", max_new_tokens=8), timeout=60).stats.new_tokens == 8
        starts = [t.start for t in ray.get(ssm.draft_timings.remote()) if t.request_id == cancelled]
        # a draft running when the release came may end later, but none starts after it
        assert max(starts) < released, (max(starts) - released, len(starts))
        if len(starts) < LONG // 4:  # it stopped long before the end
            return
    pytest.fail(f"no cancel reached the replica in {CANCEL_ATTEMPTS} attempts")


@pytest.mark.ray
def test_deadline_is_honoured_and_releases_state(serving, ingress):  # noqa: F811
    with Client(serving) as client:  # the 0.5 s deadline, not the request's end, answers the call
        with pytest.raises(grpc.RpcError) as caught:
            client.generate(build_request(PROMPTS[1], max_new_tokens=LONG), timeout=0.5)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: nothing_held(ingress)), held_requests(ingress)


@pytest.mark.ray
def test_abandoned_state_is_swept(serving, ingress):  # noqa: F811
    import ray

    from engine.draft import DraftSpec
    from engine.sampling import SamplingParams
    from engine.step import Assignment

    actors = ingress.actors.remote().result()
    ssm, verifier = actors["ssm/ssm-a"], actors["verifier"]
    assert ray.get(ssm.draft.remote("abandoned", 0, [1, 2, 3], Assignment(0, DraftSpec((2,))))) is not None
    assert ray.get(verifier.prefill.remote("abandoned", [1, 2, 3], SamplingParams())) is not None
    assert ray.get([ssm.num_requests.remote(), verifier.num_requests.remote()]) == [1, 1]
    assert ray.get(ssm.sweep.remote()) == []  # fresh: kept under the configured TTL
    assert ray.get([ssm.sweep.remote(0.0), verifier.sweep.remote(0.0)]) == [["abandoned"], ["abandoned"]]
    assert ray.get([ssm.num_requests.remote(), verifier.num_requests.remote()]) == [0, 0]
    assert ray.get(verifier.verify.remote("abandoned", None)) is None  # expired: answered, not recreated


@pytest.mark.ray
def test_releases_are_not_children_of_the_requests_task(ray_session):  # noqa: F811
    """Serve cancels a request's Ray task with its children when the client goes away (ray.cancel,
    recursive); a release sent from the request's coroutine is one of those children, and it was
    cancelled before it ran when it waited behind a call whose argument was not ready (``verify``
    waits for the merged tree): the request's state stayed in the actors. Ray makes a call the
    child of the task whose context sends it; ``ActorGroup.release`` sends from an empty context.
    """
    import ray

    class Caller:  # local: Ray pickles it by value (workers cannot import this test module)
        async def attributions(self) -> tuple[str | None, ...]:
            from actors.group import ActorGroup

            seen: list[str | None] = []

            class Release:  # an actor handle's ``release`` method: records whose child a call is
                @staticmethod
                def remote(request_id: str) -> None:
                    seen.append(ray.get_runtime_context().get_task_id())

            class Handle:
                release = Release

            own = ray.get_runtime_context().get_task_id()
            Handle.release.remote("r1")  # sent from the coroutine
            ActorGroup(names=("a",), neural=(True,), windows=(None,), ssms=(Handle(),), merge=Handle(),
                       verifier=Handle()).release("r1")
            return own, *seen

    caller = ray.remote(num_cpus=0)(Caller).remote()
    own, direct, *released = ray.get(caller.attributions.remote(), timeout=60)
    assert own is not None and direct == own  # a call from the coroutine is the request's child
    assert len(released) == 3 and own not in released, (own, direct, released)
    ray.kill(caller)


# --- distribution ------------------------------------------------------------------------


@pytest.mark.ray
def test_ssm_actors_draft_concurrently(serving, ingress, local_engine, tiny_args, tmp_path):  # noqa: F811
    """The ingress sends an iteration's drafts to every SSM before it awaits any: while SSM a's
    engine-loop calls are held (a barrier the test lifts), SSM b drafts the request's first tree.
    Sent one after the other, b's draft would wait for a's, which waits for the test: b would draft
    nothing."""
    import ray

    actors = ingress.actors.remote().result()
    a, b = actors["ssm/ssm-a"], actors["ssm/ssm-b"]
    before = {t.request_id for ssm in (a, b) for t in ray.get(ssm.draft_timings.remote())}

    def runs(ssm) -> list:
        return [t for t in ray.get(ssm.draft_timings.remote()) if t.request_id not in before]

    _, expected = local_result(local_engine, tiny_args, PROMPTS[0], max_new_tokens=40)
    reply: dict = {}

    def ask() -> None:
        with Client(serving) as client:
            reply["response"] = client.generate(build_request(PROMPTS[0], max_new_tokens=40), timeout=120)

    asking = threading.Thread(target=ask)
    with loop_hold(a, tmp_path):  # SSM a's next draft call waits for the test
        asking.start()
        assert wait_until(lambda: runs(b), timeout_s=60), "SSM b drafted nothing while SSM a was held"
        assert runs(a) == []  # a is still held: b's draft did not wait for it
    asking.join(120)
    assert list(reply["response"].token_ids) == list(expected.token_ids)
    runs_a, runs_b = runs(a), runs(b)
    assert {t.request_id for t in runs_a} == {t.request_id for t in runs_b} and len(runs_a) == len(runs_b) > 5
    assert runs_b[0].end < runs_a[0].end  # the first step: b finished while a was still held


# --- command line --------------------------------------------------------------------------


@pytest.mark.ray
def test_cli_client_json_and_errors(serving, local_engine, tiny_args, capsys):
    import json

    from cluster.cli import main

    _, expected = local_result(local_engine, tiny_args, PROMPTS[0], max_new_tokens=12)
    for extra in ([], ["--stream"]):
        assert main(["client", "--address", serving, "--prompt", PROMPTS[0], "--max-new-tokens", "12", "--json",
                     "--wait-ready", "10", *extra]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["token_ids"] == list(expected.token_ids) and result["text"] == expected.text
        assert result["finish_reason"] == "length" and result["stats"]["new_tokens"] == 12
    assert main(["client", "--address", serving, "--prompt", "hi", "--max-new-tokens", "0"]) == 1
    assert "INVALID_ARGUMENT: max_new_tokens" in capsys.readouterr().err


# --- continuous batching, paged KV pool, admission by memory -------------------------------


def pools_settled(ingress) -> bool:  # noqa: F811
    """Every paged pool (verifier and SSMs) has all its blocks free and unreserved again."""
    import ray

    actors = ingress.actors.remote().result()
    blocks = [b for b in ray.get([a.pool_blocks.remote() for n, a in actors.items() if n != "merge"]) if b]
    return bool(blocks) and all(free == unreserved == total for free, unreserved, total in blocks)


MIXED = [  # (prompt, max_new_tokens, delay before sending, cancel after this many chunks); two lanes
    (PROMPTS[0], 48, 0.0, None),  # lane 0
    (PROMPTS[1] * 3, 30, 0.0, None),  # lane 1
    ("short", 61, 0.0, None),  # lane 0, joins when its lane's first request leaves
    ("x = [i * i for i in range(10)]", 400, 0.05, 3),  # lane 1, cancelled mid-run
]  # two lanes: server.max_concurrent_requests is 2 in the tiny config


@pytest.mark.ray
def test_batched_requests_equal_each_alone_and_return_their_blocks(serving, ingress, local_engine, tiny_args,
                                                                   tmp_path):
    import ray

    verifier = ingress.actors.remote().result()["verifier"]
    before = ray.get(verifier.loop_counters.remote())
    expected = [local_result(local_engine, tiny_args, p, max_new_tokens=n)[1].token_ids for p, n, _, _ in MIXED]
    outputs: dict[int, list[int]] = {}

    def ask(index: int) -> None:
        prompt, max_new_tokens, delay, cancel_after = MIXED[index]
        time.sleep(delay)
        with Client(serving) as client:
            call = client.stream(build_request(prompt, max_new_tokens=max_new_tokens), timeout=120)
            tokens = []
            for number, chunk in enumerate(call, start=1):
                tokens.extend(chunk.token_ids)
                if number == cancel_after:
                    call.cancel()
                    break
            outputs[index] = tokens

    def lane(indices: list[int]) -> None:
        for index in indices:
            ask(index)
            wait_until(lambda: ingress.num_active.remote().result() < 2, timeout_s=30)

    threads = [threading.Thread(target=lane, args=(list(range(start, len(MIXED), 2)),)) for start in (0, 1)]
    with loop_hold(verifier, tmp_path):  # the first pass waits until both lanes' requests are in the loop,
        for thread in threads:          # so the next pass holds both, certainly
            thread.start()
        assert wait_until(lambda: ingress.num_active.remote().result() == 2, timeout_s=60)
    for thread in threads:
        thread.join(120)
    for index, (_, max_new_tokens, _, cancel_after) in enumerate(MIXED):
        got = outputs[index]
        # a cancelled stream read cancel_after chunks, each of a step's tokens (one at least)
        assert got == list(expected[index])[:len(got)]
        assert len(got) >= cancel_after if cancel_after else len(got) == max_new_tokens
    after = ray.get(verifier.loop_counters.remote())
    assert after.forwards > before.forwards and after.largest >= 2, after  # requests shared target passes
    assert wait_until(lambda: nothing_held(ingress) and pools_settled(ingress), timeout_s=60), held_requests(ingress)
