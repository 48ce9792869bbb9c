"""The OpenAI-compatible HTTP API (cluster/openai_api.py), with the official `openai` client.

Request conversion is checked without Ray; the Ray tests call the session's Serve app (tiny
models, tests/serving_fixtures.py) through Serve's HTTP proxy and compare with the gRPC service
and the in-process engine.
"""

from __future__ import annotations

import time

import pytest

from cluster.openai_api import OpenAIError, chat_call, completion_call, invalid_argument
from cluster.serve_client import Client, build_request
from cluster.serve_requests import InvalidArgument
from protos import specinfer_pb2 as pb
from serving_fixtures import (http_base, ingress, local_engine, ray_session, serving, tiny_args,  # noqa: F401
                              tiny_models)

MODEL = "tiny-target"
PROMPT = "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]


# --- request conversion, without Ray ----------------------------------------------------------


def test_completion_fields_map_to_the_grpc_request():
    call = completion_call({"model": MODEL, "prompt": ["hello"], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                            "seed": 3, "stop": "\n", "top_k": 40, "n": 1, "logprobs": None, "presence_penalty": 0,
                            "speculation": {"mode": "sequence", "sequence_depth": 3, "ssms": ["ssm-a"],
                                            "children": "sampled", "expansion": [2, 1], "adaptive": False},
                            "stream": True, "stream_options": {"include_usage": True}, "user": "ignored"}, MODEL)
    r = call.request
    assert (r.prompt, r.max_new_tokens, r.temperature, r.top_p, r.seed, list(r.stop), r.top_k) == \
        ("hello", 7, 0.5, 0.9, 3, ["\n"], 40)
    assert r.speculation.mode == pb.SPECULATION_MODE_SEQUENCE and r.speculation.sequence_depth == 3
    assert list(r.speculation.ssms) == ["ssm-a"] and list(r.speculation.expansion) == [2, 1]
    assert r.speculation.children == pb.CHILDREN_RULE_SAMPLED
    assert r.speculation.HasField("adaptive") and not r.speculation.adaptive
    assert call.stream and call.include_usage and not call.chat and not call.return_token_ids
    unset = completion_call({"prompt": "x"}, MODEL).request  # unset: the server's defaults apply
    assert not any(unset.HasField(f) for f in ("max_new_tokens", "temperature", "top_p", "top_k", "seed",
                                               "speculation"))


def test_chat_fields_map_to_the_grpc_request():
    call = chat_call({"model": MODEL, "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}], "max_tokens": 5, "max_completion_tokens": 9,
        "stop": ["x", "y"], "logprobs": False, "tool_choice": "none", "return_token_ids": True}, MODEL)
    r = call.request
    assert [(m.role, m.content) for m in r.messages] == [("system", "sys"), ("user", "a\nb"), ("assistant", "")]
    assert r.max_new_tokens == 9 and call.max_tokens_param == "max_completion_tokens"  # the newer name wins
    assert list(r.stop) == ["x", "y"] and call.chat and call.return_token_ids and not call.stream


UNSUPPORTED = [
    ("completions", {"n": 2}, "n"), ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"logprobs": 1}, "logprobs"), ("completions", {"logprobs": 0}, "logprobs"),
    ("completions", {"echo": True}, "echo"), ("completions", {"suffix": "}"}, "suffix"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -1}, "frequency_penalty"),
    ("completions", {"logit_bias": {"50256": -100}}, "logit_bias"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"), ("completions", {"prompt": [1, 2, 3]}, "prompt"),
    ("completions", {"prompt": None}, "prompt"), ("completions", {"max_tokens": "many"}, "max_tokens"),
    ("completions", {"temperature": True}, "temperature"), ("completions", {"stop": 3}, "stop"),
    ("completions", {"seed": 2**70}, "seed"), ("completions", {"speculation": {"depth": 2}}, "speculation"),
    ("completions", {"speculation": {"mode": "beam"}}, "speculation.mode"),
    ("completions", {"speculation": {"expansion": [2, "x"]}}, "speculation.expansion"),
    ("completions", {"speculation": {"adaptive": "no"}}, "speculation.adaptive"),
    ("completions", {"speculation": {"adaptive": 0}}, "speculation.adaptive"),
    ("completions", {"speculation": {"prefetch": "2"}}, "speculation.prefetch"),
    ("chat", {"n": 2}, "n"), ("chat", {"logprobs": True}, "logprobs"), ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"messages": []}, "messages"), ("chat", {"messages": [{"content": "no role"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
]


@pytest.mark.parametrize("api,fields,param", UNSUPPORTED, ids=[f"{a}-{p}-{i}" for i, (a, _, p) in
                                                                enumerate(UNSUPPORTED)])
def test_unsupported_and_bad_parameters_are_400(api, fields, param):
    base = {"model": MODEL, "prompt": "hi"} if api == "completions" else {"model": MODEL, "messages": MESSAGES}
    with pytest.raises(OpenAIError) as caught:
        (completion_call if api == "completions" else chat_call)({**base, **fields}, MODEL)
    error = caught.value.body()["error"]
    assert caught.value.status == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and error["code"]


ADAPTIVE = [  # (the HTTP speculation extra, the server's default, SpeculationOptions.adaptive the server uses)
    ({}, True, True),  # unset: the server's default, whichever it is
    ({}, False, False),
    ({"adaptive": None}, False, False),
    ({"adaptive": True}, False, True),
    ({"adaptive": False}, True, False),
    ({"mode": "tree", "adaptive": False}, True, False),
]


@pytest.mark.parametrize("extra,default,adaptive", ADAPTIVE)
def test_adaptive_reaches_the_speculation_options(extra, default, adaptive):
    from cluster.serve_requests import ModelLimits, speculation_options
    from engine.requests import SpeculationOptions

    request = completion_call({"prompt": "hi", "speculation": extra}, MODEL).request
    limits = ModelLimits(("ssm-a", "suffix"), (True, False), None)
    assert speculation_options(request, SpeculationOptions(adaptive=default), limits).adaptive is adaptive
    assert build_request("hi", adaptive=False).speculation.adaptive is False  # the gRPC client's spelling


PREFETCH = [  # (the HTTP speculation extra, the server's default, whether the server can prefetch, result)
    ({}, 2, True, 2),  # unset: the server's default
    ({"prefetch": 0}, 2, True, 0),
    ({"prefetch": 3}, 0, True, 3),
    ({"prefetch": 9}, 0, True, "speculation.prefetch: must be in [0, 8], got 9"),
    ({"prefetch": -1}, 0, True, "speculation.prefetch: must be in [0, 8], got -1"),
    ({"prefetch": 1}, 0, False, "speculation.prefetch: needs a neural SSM"),  # the suffix proposer alone
    ({"prefetch": 0}, 0, False, 0),  # off is always fine
]


@pytest.mark.parametrize("extra,default,can,expected", PREFETCH)
def test_prefetch_reaches_the_speculation_options_within_its_bound(extra, default, can, expected):
    from cluster.serve_requests import ModelLimits, speculation_options
    from engine.requests import SpeculationOptions

    request = completion_call({"prompt": "hi", "speculation": extra}, MODEL).request
    limits = ModelLimits(("ssm-a", "suffix"), (True, False), None, prefetch=can)
    if isinstance(expected, int):
        assert speculation_options(request, SpeculationOptions(prefetch=default), limits).prefetch == expected
        return
    with pytest.raises(InvalidArgument) as caught:
        speculation_options(request, SpeculationOptions(prefetch=default), limits)
    assert str(caught.value).startswith(expected)


def test_unknown_model_is_404_and_field_names_are_openai_names():
    with pytest.raises(OpenAIError) as caught:
        completion_call({"model": "gpt-4", "prompt": "hi"}, MODEL)
    assert caught.value.status == 404 and caught.value.code == "model_not_found"
    with pytest.raises(OpenAIError):
        completion_call(["not", "an", "object"], MODEL)
    chat = chat_call({"messages": MESSAGES, "max_completion_tokens": 5}, MODEL)
    completion = completion_call({"prompt": "hi"}, MODEL)
    assert invalid_argument(InvalidArgument("max_new_tokens", "too many"), chat).param == "max_completion_tokens"
    assert invalid_argument(InvalidArgument("max_new_tokens", "too many"), completion).param == "max_tokens"
    assert invalid_argument(InvalidArgument("prompt", "too long"), chat).param == "messages"
    assert invalid_argument(InvalidArgument("top_p", "bad"), chat).message == "top_p: bad"


# --- served, through the openai client ----------------------------------------------------------


@pytest.fixture(scope="module")
def openai_client(http_base):  # noqa: F811
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{http_base}/v1", api_key="unused", max_retries=0, timeout=90) as client:
        yield client


def engine_result(engine, args, prompt=None, messages=None, max_new_tokens=32, stop=()):
    """The in-process engine's greedy answer with the server's speculation options."""
    from cluster.build import speculation_options
    from settings.config import EngineConfig
    from engine.requests import GenerationRequest
    from engine.sampling import SamplingParams

    tok = engine.tokenizer
    if prompt is not None:
        ids = tok.encode(prompt)
    else:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    options = speculation_options(EngineConfig.model_validate(args))
    request = GenerationRequest(tuple(ids), max_new_tokens, SamplingParams(), options, tuple(stop))
    return ids, engine.generate(request)


@pytest.mark.ray
def test_models_lists_the_target(openai_client):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "specinfer"
    assert openai_client.models.retrieve(MODEL).id == MODEL


@pytest.mark.ray
def test_greedy_completion_equals_grpc_and_engine(openai_client, serving, local_engine, tiny_args):  # noqa: F811
    ids, expected = engine_result(local_engine, tiny_args, PROMPT, max_new_tokens=40)
    with Client(serving) as client:
        grpc_reply = client.generate(build_request(PROMPT, max_new_tokens=40, temperature=0.0), timeout=60)
    reply = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                             extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    assert choice.text == grpc_reply.text == expected.text and choice.finish_reason == "length"
    assert choice.model_extra["token_ids"] == list(grpc_reply.token_ids) == list(expected.token_ids)
    assert reply.object == "text_completion" and reply.model == MODEL and reply.id.startswith("cmpl-")
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 40, len(ids) + 40)
    speculation = usage.model_extra["speculation"]
    assert speculation["target_steps"] == expected.stats.target_steps == grpc_reply.stats.target_steps
    assert speculation["accepted_per_ssm"] == expected.stats.accepted_per_proposer
    assert speculation["draft_tokens"] == grpc_reply.stats.draft_tokens
    assert speculation["accepted_tokens"] == grpc_reply.stats.accepted_tokens
    assert speculation["tokens_per_step"] == pytest.approx(40 / expected.stats.target_steps)

    chunks = list(openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 40  # the include_usage chunk
    assert chunks[-1].usage.model_extra["speculation"]["target_steps"] == expected.stats.target_steps


@pytest.mark.ray
def test_chat_completion_equals_engine(openai_client, local_engine, tiny_args):  # noqa: F811
    _, plain = engine_result(local_engine, tiny_args, messages=MESSAGES, max_new_tokens=40)
    stop = plain.text[12:14]  # a string the output really contains
    _, expected = engine_result(local_engine, tiny_args, messages=MESSAGES, max_new_tokens=40, stop=[stop])
    assert expected.finish_reason == "stop"
    reply = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=40, stop=stop)
    message = reply.choices[0].message
    assert message.role == "assistant" and message.content == expected.text
    assert reply.choices[0].finish_reason == "stop" and reply.object == "chat.completion"
    assert reply.usage.completion_tokens == expected.stats.new_tokens

    stream = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.text
    assert chunks[-1].choices[0].finish_reason == "length" and len({c.id for c in chunks}) == 1


@pytest.mark.ray
def test_bad_requests_answer_openai_errors(openai_client):
    import openai

    cases = [
        (lambda: openai_client.completions.create(model=MODEL, prompt="hi", n=2), 400, "n"),
        (lambda: openai_client.completions.create(model=MODEL, prompt="hi", logprobs=2), 400, "logprobs"),
        (lambda: openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2), 400, "n"),
        (lambda: openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True,
                                                       top_logprobs=2), 400, "logprobs"),
        (lambda: openai_client.completions.create(model=MODEL, prompt="hi", max_tokens=0), 400, "max_tokens"),
        (lambda: openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10**6),
         400, "max_completion_tokens"),
        (lambda: openai_client.completions.create(model=MODEL, prompt="hi", stream=True, top_p=0), 400, "top_p"),
        (lambda: openai_client.completions.create(model=MODEL, prompt="x" * 600), 400, "prompt"),
        (lambda: openai_client.completions.create(model=MODEL, prompt="hi", extra_body={"speculation": {
            "ssms": ["nope"]}}), 400, "speculation.ssms"),
        (lambda: openai_client.completions.create(model="gpt-4", prompt="hi"), 404, "model"),
    ]
    for call, status, param in cases:
        with pytest.raises(openai.APIStatusError) as caught:
            call()
        error = caught.value
        assert error.status_code == status, (param, error)
        assert error.param == param and error.type == "invalid_request_error", error.body
        assert error.message and error.code
    assert openai_client.completions.create(model=MODEL, prompt="still serving", max_tokens=3).usage \
        .completion_tokens == 3


def _held(ingress) -> dict:  # noqa: F811
    import ray

    actors = ingress.actors.remote().result()
    counts = dict(zip(actors, ray.get([a.num_requests.remote() for a in actors.values()])))
    return {"ingress": ingress.num_active.remote().result(), **counts}


def _wait_nothing_held(ingress, timeout_s: float = 30.0) -> dict:  # noqa: F811
    deadline = time.monotonic() + timeout_s
    while any((held := _held(ingress)).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return held


@pytest.mark.ray
def test_overload_is_429(openai_client, serving, ingress):  # noqa: F811
    import openai

    with Client(serving) as client:
        calls = [client.stream(build_request(PROMPT, max_new_tokens=400), timeout=120) for _ in range(2)]
        try:
            for call in calls:
                next(call)  # admitted: max_concurrent_requests is 2
            with pytest.raises(openai.RateLimitError) as caught:
                openai_client.completions.create(model=MODEL, prompt="one too many", max_tokens=4)
            assert caught.value.status_code == 429 and "max_concurrent_requests" in caught.value.message
            assert caught.value.response.headers.get("retry-after") == "1"
        finally:
            for call in calls:
                call.cancel()
    assert not any(_wait_nothing_held(ingress).values())


@pytest.mark.ray
def test_closed_stream_releases_state(openai_client, ingress):  # noqa: F811
    stream = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=True)
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break
    stream.close()  # the client goes away mid-generation
    held = _wait_nothing_held(ingress)
    assert not any(held.values()), held


@pytest.mark.ray
def test_stream_is_server_sent_events(http_base):  # noqa: F811
    import json
    import urllib.request

    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": True,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{http_base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("\n\ndata: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 8
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
