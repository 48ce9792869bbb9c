"""Bad input, fuzzed: every GenerateRequest field (from the proto descriptor), raw bytes on the
gRPC wire, and JSON bodies and garbage on the OpenAI routes, against the session's Serve app.

Every case must be answered with a documented code: gRPC OK, INVALID_ARGUMENT whose details
start with the offending field's path (``stop[3]: ...``) or RESOURCE_EXHAUSTED; HTTP 200, 400 with
an OpenAI error body naming the parameter, 404 (another model) or 429. No INTERNAL / 500, no
hang (each call has a deadline), and the server still serves at the end. Hypothesis runs
derandomized with bounded example counts, so the cases are the same on every run; the module
prints the tally of cases by answer (docs/serving.md, "Bad input").
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from collections import Counter

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.serve_client import Client, build_request
from protos import specinfer_pb2 as pb
from serving_fixtures import (http_base, ray_session, serving, tiny_args, tiny_models)  # noqa: F401  (fixtures)

MODEL = "tiny-target"
TALLY: Counter = Counter()  # (surface, answer) -> cases
# Derandomised, no database, no deadline: the suite's profile (tests/conftest.py).
FUZZ = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
GRPC_OK = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
HTTP_OK = {200, 400, 404, 429}
FIELD_PATH = re.compile(r"^[a-z_]+(\[\d+\])?(\.[a-z_]+(\[\d+\])?)*$")
CALL_TIMEOUT_S = 60.0

EDGE_TEXT = ["", " ", "\x00", "\n\n\n", "hello", "x" * 600, "\u202e\u200b\ufeff", "\U0001f642" * 30, "e\u0301",
             "\uffff", "\U0010ffff", "<|user|>", "{{ raise_exception('x') }}", "{% for %}", "suffix", "ssm-a",
             "ssm-b", "nope", "user", "system", "assistant"]
INVALID_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"a\x80b", b"\xe2\x82"]


# --- strategies from the descriptor -------------------------------------------------------------

def _scalar(field) -> st.SearchStrategy:
    if field.type == FD.TYPE_STRING:
        return st.one_of(st.sampled_from(EDGE_TEXT), st.text(max_size=40))
    if field.type in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return st.one_of(st.sampled_from([0, 1, 2, -1, 64, 65, 2**31 - 1, -2**31]), st.integers(-2**31, 2**31 - 1))
    if field.type in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return st.one_of(st.sampled_from([0, 1, -1, 2**63 - 1, -2**63]), st.integers(-2**63, 2**63 - 1))
    if field.type in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if field.type in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if field.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        edges = [0.0, -0.0, 1.0, 0.5, 5e-324, 1e-300, 1e-4, 1e308, math.inf, -math.inf, math.nan]
        return st.one_of(st.sampled_from(edges), st.floats(width=64 if field.type == FD.TYPE_DOUBLE else 32))
    if field.type == FD.TYPE_BOOL:
        return st.booleans()
    if field.type == FD.TYPE_BYTES:
        return st.binary(max_size=40)
    if field.type == FD.TYPE_ENUM:
        known = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-2**31, 2**31 - 1))  # proto3 enums are open
    raise NotImplementedError(f"{field.full_name}: field type {field.type}")


# Narrowed so that valid requests stay short: no valid max_new_tokens above 3.
OVERRIDES = {"specinfer.v1.GenerateRequest.max_new_tokens":
             st.one_of(st.integers(1, 3), st.sampled_from([0, -1, 401, 2**31 - 1, -2**31]))}
REQUIRED = {"specinfer.v1.GenerateRequest.max_new_tokens"}


def _value(field) -> st.SearchStrategy:
    if field.full_name in OVERRIDES:
        return OVERRIDES[field.full_name]
    if field.type == FD.TYPE_MESSAGE:
        return message_dicts(field.message_type)
    return _scalar(field)


def _field(field) -> st.SearchStrategy:
    single = _value(field)
    if not field.is_repeated:
        return single
    many = st.builds(lambda value, n: [value] * n, single, st.sampled_from([17, 2000, 5000]))  # thousands
    return st.one_of(st.lists(single, max_size=4), many) if field.type != FD.TYPE_MESSAGE else \
        st.lists(single, max_size=3)


def message_dicts(descriptor) -> st.SearchStrategy[dict]:
    """Dicts of field name -> value for ``descriptor``; every field may be absent (unset) except
    REQUIRED ones. Message fields recurse, so new fields and messages are covered."""
    fields = {f.name: _field(f) for f in descriptor.fields}
    required = {name: strategy for name, strategy in fields.items()
                if f"{descriptor.full_name}.{name}" in REQUIRED}
    optional = {name: strategy for name, strategy in fields.items() if name not in required}
    return st.fixed_dictionaries(required, optional=optional)


def build(message, values: dict):
    """Fill a proto message from message_dicts' values."""
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        if field.type == FD.TYPE_MESSAGE and field.is_repeated:
            for item in value:
                build(getattr(message, name).add(), item)
        elif field.type == FD.TYPE_MESSAGE:
            getattr(message, name).SetInParent()
            build(getattr(message, name), value)
        elif field.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message


# --- answers ----------------------------------------------------------------------------------

def grpc_answer(call, request) -> tuple[str, str]:
    try:
        call(request, timeout=CALL_TIMEOUT_S)
        return "OK", ""
    except grpc.RpcError as error:
        return error.code().name, error.details() or ""


def check_grpc(surface: str, code: str, details: str) -> None:
    TALLY[(surface, code)] += 1
    assert code in GRPC_OK, (code, details[:500])
    if code == "INVALID_ARGUMENT":
        field = details.split(":", 1)[0]
        assert FIELD_PATH.match(field), details[:500]
        root = field.split(".")[0].split("[")[0]
        assert root == "request" or root in pb.GenerateRequest.DESCRIPTOR.fields_by_name, details[:500]


@pytest.fixture(scope="module")
def client(serving):  # noqa: F811
    with Client(serving) as c:
        yield c


@pytest.fixture(scope="module")
def raw_generate(client):
    """Generate with identity (de)serializers: the bytes go on the wire as they are."""
    return client.channel.unary_unary("/specinfer.v1.SpecInfer/Generate", request_serializer=None,
                                      response_deserializer=None)


# --- gRPC ------------------------------------------------------------------------------------


@pytest.mark.ray
@settings(FUZZ, max_examples=150)
@given(values=message_dicts(pb.GenerateRequest.DESCRIPTOR), streaming=st.booleans())
def test_generate_request_fields(client, values, streaming):
    request = build(pb.GenerateRequest(), values)
    if streaming:
        code, details = grpc_answer(lambda r, timeout: list(client.stream(r, timeout)), request)
    else:
        code, details = grpc_answer(client.generate, request)
    check_grpc("grpc fields", code, details)


def _ld(number: int, payload: bytes) -> bytes:
    """A length-delimited field on the wire (tag, varint length, payload)."""
    length, size = b"", len(payload)
    while True:
        byte, size = size & 0x7F, size >> 7
        length += bytes([byte | (0x80 if size else 0)])
        if not size:
            break
    return bytes([number << 3 | 2]) + length + payload


# (wire bytes with `bad` in one string field, the field path the answer must name)
UTF8_PLACES = {
    "prompt": lambda bad: _ld(1, bad),
    "stop[1]": lambda bad: _ld(1, b"hi") + _ld(8, b"ok") + _ld(8, bad),
    "messages[0].content": lambda bad: _ld(2, _ld(1, b"user") + _ld(2, bad)),
    "messages[1].role": lambda bad: _ld(2, _ld(1, b"user")) + _ld(2, _ld(1, bad)),
    "speculation.ssms[0]": lambda bad: _ld(1, b"hi") + _ld(9, _ld(3, bad)),
}
MAX_NEW_TOKENS_2 = b"\x18\x02"  # field 3 (max_new_tokens) = 2; the last value of a scalar wins


@pytest.mark.parametrize("place", sorted(UTF8_PLACES))
def test_decode_request_names_the_invalid_utf8_field(place):
    from cluster.serve_requests import InvalidArgument
    from cluster.wire import decode_request

    for bad in INVALID_UTF8:
        with pytest.raises(InvalidArgument) as caught:
            decode_request(UTF8_PLACES[place](bad))
        assert caught.value.field == place
    assert decode_request(UTF8_PLACES[place](b"fine") + MAX_NEW_TOKENS_2).max_new_tokens == 2


@pytest.mark.ray
@settings(FUZZ, max_examples=40)
@given(place=st.sampled_from(sorted(UTF8_PLACES)), bad=st.sampled_from(INVALID_UTF8))
def test_invalid_utf8_names_the_field(raw_generate, place, bad):
    code, details = grpc_answer(raw_generate, UTF8_PLACES[place](bad) + MAX_NEW_TOKENS_2)
    check_grpc("grpc invalid utf-8", code, details)
    assert code == "INVALID_ARGUMENT" and details.startswith(f"{place}: "), details


@pytest.mark.ray
@settings(FUZZ, max_examples=60)
@given(garbage=st.one_of(st.binary(max_size=200),
                         st.builds(lambda valid, cut: valid[:cut],
                                   st.just(build_request("hello", max_new_tokens=2).SerializeToString()),
                                   st.integers(1, 8))))
def test_raw_bytes(raw_generate, garbage):
    code, details = grpc_answer(raw_generate, garbage + MAX_NEW_TOKENS_2)
    check_grpc("grpc raw bytes", code, details)


HUGE = 262_144 + 1  # one over the default server.max_prompt_chars
LIMIT_CASES = [  # (request, the field named)
    (pb.GenerateRequest(prompt="x" * HUGE, max_new_tokens=2), "prompt"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x" * HUGE)], max_new_tokens=2), "messages"),
    (pb.GenerateRequest(prompt="x" * 600, max_new_tokens=2), "prompt"),  # over the 512-token context
    (pb.GenerateRequest(prompt="hi", stop=["s"] * 5000, max_new_tokens=2), "stop"),
    (pb.GenerateRequest(prompt="hi", stop=["ok", "s" * 257], max_new_tokens=2), "stop[1]"),
    (pb.GenerateRequest(prompt="hi", temperature=5e-324, max_new_tokens=2), "temperature"),
    (pb.GenerateRequest(prompt="hi", temperature=0.7, top_p=5e-324, max_new_tokens=2), "top_p"),
    (build_request("hi", max_new_tokens=2, ssms=["nope"]), "speculation.ssms"),
    (pb.GenerateRequest(prompt="hi", max_new_tokens=2, speculation=pb.SpeculationOptions(mode=7)),
     "speculation.mode"),
    (pb.GenerateRequest(prompt="hi", max_new_tokens=2, speculation=pb.SpeculationOptions(children=-1)),
     "speculation.children"),
]


@pytest.mark.ray
@pytest.mark.parametrize("request_,field", LIMIT_CASES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(LIMIT_CASES)])
def test_limits_name_the_field(client, request_, field):
    code, details = grpc_answer(client.generate, request_)
    check_grpc("grpc limits", code, details)
    assert code == "INVALID_ARGUMENT" and details.startswith(f"{field}: "), details[:300]


# --- HTTP ------------------------------------------------------------------------------------

JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
                        st.sampled_from(["\ud800", "a\udfffb", "x" * 600, MODEL]))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
SHORT = st.integers(1, 3)
GARBAGE_MAX = JSON_VALUES.filter(lambda v: v is not None and not (type(v) is int and 0 < v <= 400))
SPECULATION = st.fixed_dictionaries({}, optional={
    "mode": st.one_of(st.sampled_from(["tree", "sequence", "incremental", "beam"]), JSON_VALUES),
    "children": st.one_of(st.sampled_from(["top_k", "sampled", "sampled_without_replacement"]), JSON_VALUES),
    "expansion": st.one_of(st.lists(st.integers(-3, 70), max_size=4), JSON_VALUES),
    "ssms": st.one_of(st.lists(st.sampled_from(["ssm-a", "ssm-b", "suffix", "nope", "\ud800"]), max_size=3),
                      JSON_VALUES),
    "sequence_depth": st.one_of(st.integers(-1, 40), JSON_VALUES), "adaptive": st.one_of(st.booleans(), JSON_VALUES),
    "bogus": JSON_VALUES})
COMMON = {
    "model": st.one_of(st.just(MODEL), JSON_VALUES), "temperature": st.one_of(st.floats(0, 2), JSON_VALUES),
    "top_p": st.one_of(st.floats(0, 1), JSON_VALUES), "top_k": st.one_of(st.integers(-1, 100), JSON_VALUES),
    "seed": st.one_of(st.integers(), JSON_VALUES),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20),
                      st.just(["s"] * 3000), JSON_VALUES),
    "stream": st.one_of(st.booleans(), JSON_VALUES), "stream_options": st.one_of(
        st.fixed_dictionaries({"include_usage": st.booleans()}), JSON_VALUES),
    "n": st.one_of(st.just(1), JSON_VALUES), "logprobs": JSON_VALUES, "speculation": st.one_of(SPECULATION, JSON_VALUES),
    "return_token_ids": st.one_of(st.booleans(), JSON_VALUES), "user": JSON_VALUES, "unknown_field": JSON_VALUES,
}
MESSAGES = st.one_of(st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", ""]), JSON_VALUES)},
    optional={"content": st.one_of(st.text(max_size=30), st.sampled_from(["\ud800", "x" * 600]), JSON_VALUES)}),
    max_size=3), JSON_VALUES)
COMPLETION_BODY = st.fixed_dictionaries(
    {"max_tokens": st.one_of(SHORT, GARBAGE_MAX)},
    optional={"prompt": st.one_of(st.text(max_size=30), st.sampled_from(EDGE_TEXT), JSON_VALUES), **COMMON})
CHAT_BODY = st.fixed_dictionaries(
    {"max_completion_tokens": st.one_of(SHORT, GARBAGE_MAX)}, optional={"messages": MESSAGES, **COMMON})


def post(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
    request = urllib.request.Request(url, body, {"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def check_http(surface: str, status: int, raw: bytes) -> None:
    TALLY[(surface, status)] += 1
    assert status in HTTP_OK, (status, raw[:500])
    if status == 200:
        return
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if status == 400 and error["code"] != "invalid_json":
        assert error["param"] and FIELD_PATH.match(error["param"]), error
        assert error["message"].startswith(f"{error['param']}: "), error


@pytest.mark.ray
@settings(FUZZ, max_examples=100)
@given(route=st.sampled_from(["completions", "chat/completions"]), data=st.data())
def test_openai_bodies(http_base, route, data):  # noqa: F811
    body = data.draw(COMPLETION_BODY if route == "completions" else CHAT_BODY)
    status, raw = post(f"{http_base}/v1/{route}", json.dumps(body).encode())  # NaN/inf: Python's JSON extension
    check_http("http bodies", status, raw)


VALID_COMPLETION = st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=30), "max_tokens": SHORT}, optional={
    "model": st.just(MODEL), "temperature": st.sampled_from([0, 0.5, 1.0]), "top_p": st.sampled_from([0.5, 1]),
    "top_k": st.integers(0, 50), "seed": st.integers(0, 2**31), "stop": st.lists(st.text(max_size=5), max_size=4),
    "stream": st.booleans(), "return_token_ids": st.booleans(),
    "speculation": st.fixed_dictionaries({}, optional={
        "mode": st.sampled_from(["tree", "sequence", "incremental"]), "ssms": st.sampled_from([["ssm-a"], ["suffix"]]),
        "expansion": st.lists(st.integers(1, 3), min_size=1, max_size=3)})})


@pytest.mark.ray
@settings(FUZZ, max_examples=25)
@given(body=VALID_COMPLETION)
def test_openai_plausible_bodies(http_base, body):  # noqa: F811
    """Bodies that are mostly valid, so the 200 path (and streaming) is fuzzed too."""
    status, raw = post(f"{http_base}/v1/completions", json.dumps(body).encode())
    check_http("http plausible", status, raw)


MALFORMED_JSON = [b"", b"{", b'{"prompt": }', b"[1, 2", b"nul", b"\xff\xfe{}", b"[" * 100_000, b'{"a":' * 50_000,
                  b'"just a string"', b"42", b"null", b'{"prompt": "\\ud800"}', b'{"prompt": "a", "prompt": 3}']


@pytest.mark.ray
@settings(FUZZ, max_examples=40)
@given(route=st.sampled_from(["completions", "chat/completions"]),
       body=st.one_of(st.sampled_from(MALFORMED_JSON), st.binary(max_size=100)),
       content_type=st.sampled_from(["application/json", "text/plain", "application/octet-stream"]))
def test_openai_garbage(http_base, route, body, content_type):  # noqa: F811
    status, raw = post(f"{http_base}/v1/{route}", body, content_type)
    check_http("http garbage", status, raw)


# --- after all of it ----------------------------------------------------------------------------


@pytest.mark.ray
def test_server_alive_after_fuzzing(client, http_base, capsys):  # noqa: F811
    client.wait_ready(30)
    reply = client.generate(build_request("still alive?", max_new_tokens=3), timeout=CALL_TIMEOUT_S)
    assert len(reply.token_ids) == 3
    status, raw = post(f"{http_base}/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2
    with urllib.request.urlopen(f"{http_base}/health", timeout=30) as response:
        assert response.status == 200
    total = sum(TALLY.values())
    with capsys.disabled():
        print(f"\nfuzz: {total} cases")
        for (surface, answer), count in sorted(TALLY.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            print(f"  {surface:20s} {answer!s:20s} {count}")
    if total:  # the whole module ran (not a -k selection of this test)
        assert total >= 300, TALLY
