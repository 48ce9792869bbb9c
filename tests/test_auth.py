"""Access: bearer-token authentication (cluster/auth.py), request ids in log lines, model loading
safety (no remote code unless a model asks for it, no pickled weights).

The Ray tests deploy a second application, ``specinfer-auth`` (route prefix ``/auth``), on the
session's Serve instance with SPECINFER_AUTH_TOKEN in its replica's environment; the shared
``specinfer`` application stays auth-off for the other modules.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.auth import Unauthenticated, auth_token, authorized, check_header, check_metadata
from cluster.serve_client import Client, build_request
from protos import specinfer_pb2_grpc
from serving_fixtures import (http_base, ray_session, serving, tiny_args, tiny_models)  # noqa: F401  (fixtures)
from settings.config import EngineConfig, ModelConfig, ServerConfig

TOKEN = "s3cret-token"
AUTH_APP, AUTH_PREFIX = "specinfer-auth", "/auth"
MODEL = "tiny-target"


# --- without Ray ------------------------------------------------------------------------------

@pytest.mark.parametrize("environ,expected", [
    ({}, None), ({"SPECINFER_AUTH_TOKEN": ""}, None), ({"SPECINFER_AUTH_TOKEN": TOKEN}, TOKEN),
    ({"OTHER": TOKEN}, None)])
def test_auth_is_on_only_when_the_env_var_is_set(environ, expected):
    assert auth_token(ServerConfig(), environ) == expected
    assert auth_token(ServerConfig(auth_token_env=None), {"SPECINFER_AUTH_TOKEN": TOKEN}) is None
    assert auth_token(ServerConfig(auth_token_env="OTHER"), {"OTHER": TOKEN}) == TOKEN


@pytest.mark.parametrize("header,ok", [
    (f"Bearer {TOKEN}", True), (f"bearer {TOKEN}", True), (f"  Bearer   {TOKEN} ", True), (None, False), ("", False),
    (TOKEN, False), (f"Basic {TOKEN}", False), ("Bearer wrong", False), (f"Bearer {TOKEN}x", False),
    ("Bearer ", False), ("Bearer \udcff", False)])
def test_bearer_header(header, ok):
    assert authorized(header, TOKEN) is ok


def test_tokens_are_compared_in_constant_time(monkeypatch):
    import hmac

    calls = []
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or a == b)
    assert authorized(f"Bearer {TOKEN}", TOKEN) and calls == [(TOKEN.encode(), TOKEN.encode())]


@pytest.mark.parametrize("metadata,error", [
    ((), "missing"), ((("application", "specinfer"),), "missing"), ((("authorization", "Bearer no"),), "invalid"),
    ((("authorization", f"Bearer {TOKEN}"),), None), ((("Authorization", f"Bearer {TOKEN}"),), None),
    ((("authorization", "Bearer no"), ("authorization", f"Bearer {TOKEN}")), None)])
def test_grpc_metadata_check(metadata, error):
    if error is None:
        check_metadata(metadata, TOKEN)
    else:
        with pytest.raises(Unauthenticated, match=error):
            check_metadata(metadata, TOKEN)
    check_metadata(metadata, None)  # auth off: anything goes
    check_header(None, None)


def test_request_id_on_every_log_line_of_a_request(caplog):
    from cluster import request_log

    request_log.install()
    logger = logging.getLogger("cluster.test_request_log")
    with caplog.at_level(logging.INFO, logger="cluster.test_request_log"):
        logger.info("before")
        with request_log.request_logging("abc123"):
            logger.info("admitted %d tokens", 5)
            logging.getLogger("engine.step").warning("from another module")
        logger.info("after")
        with request_log.request_logging("abc123"):  # Serve logs with extra={"request_id": ...}
            logger.info("serve's own", extra={"request_id": "serve-id"})
    lines = [record.getMessage() for record in caplog.records if "serve's own" not in record.getMessage()]
    assert lines == ["before", "admitted 5 tokens request_id=abc123", "from another module request_id=abc123",
                     "after"]


def test_trust_remote_code_is_off_unless_a_model_sets_it():
    from actors.loading import model_spec
    from engine.models import pretrained_args

    config = EngineConfig.model_validate({"target": {"name": "t", "source": "org/model"},
                                          "ssms": [{"name": "s", "source": "org/ssm", "trust_remote_code": True}]})
    assert ModelConfig(name="m", source="x").trust_remote_code is False
    assert pretrained_args(model_spec(config, config.target))[1]["trust_remote_code"] is False
    assert pretrained_args(model_spec(config, config.ssms[0]))[1]["trust_remote_code"] is True


def test_pickled_weights_are_refused(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models import ModelSpec, load_model

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    config.save_pretrained(tmp_path)
    torch.save(LlamaForCausalLM(config).state_dict(), tmp_path / "pytorch_model.bin")  # pickle only
    with pytest.raises(OSError, match="safetensors"):
        load_model(ModelSpec("pickled", str(tmp_path), dtype="float32", device="cpu"))


# --- served -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def auth_app(serving, tiny_args):  # noqa: F811
    """The tiny app again as ``specinfer-auth`` with SPECINFER_AUTH_TOKEN set in its replica."""
    from ray import serve

    from cluster.serve_app import SpecInferIngress

    config = EngineConfig.model_validate(tiny_args)
    env = {"runtime_env": {"env_vars": {"SPECINFER_AUTH_TOKEN": TOKEN}}, "num_cpus": 0.1}
    serve.run(SpecInferIngress.options(ray_actor_options=env).bind(config), name=AUTH_APP, route_prefix=AUTH_PREFIX,
              blocking=False)
    try:
        with Client(serving, application=AUTH_APP) as client:
            client.wait_ready(300)  # grpc.health.v1 needs no token
        yield serving
    finally:
        serve.delete(AUTH_APP)


def grpc_code(address: str, metadata: tuple, streaming: bool) -> str:
    with grpc.insecure_channel(address) as channel:
        stub = specinfer_pb2_grpc.SpecInferStub(channel)
        request = build_request("hi", max_new_tokens=2)
        metadata = (("application", AUTH_APP), *metadata)
        try:
            if streaming:
                list(stub.GenerateStream(request, timeout=60, metadata=metadata))
            else:
                stub.Generate(request, timeout=60, metadata=metadata)
        except grpc.RpcError as error:
            return error.code().name
    return "OK"


GRPC_CASES = [((), "UNAUTHENTICATED"), ((("authorization", "Bearer wrong"),), "UNAUTHENTICATED"),
              ((("authorization", TOKEN),), "UNAUTHENTICATED"), ((("authorization", f"Bearer {TOKEN}"),), "OK")]


@pytest.mark.ray
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("metadata,code", GRPC_CASES)
def test_grpc_needs_the_token(auth_app, metadata, code, streaming):
    assert grpc_code(auth_app, metadata, streaming) == code


@pytest.mark.ray
def test_grpc_health_is_exempt_and_the_shared_app_is_open(auth_app):
    with grpc.insecure_channel(auth_app) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30,
                                                          metadata=(("application", AUTH_APP),))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with Client(auth_app) as client:  # the session's `specinfer` app: no token needed
        assert len(client.generate(build_request("hi", max_new_tokens=2), timeout=60).token_ids) == 2
    with Client(auth_app, application=AUTH_APP, token=TOKEN) as client:  # `specinfer client` and the benches
        assert len(client.generate(build_request("hi", max_new_tokens=2), timeout=60).token_ids) == 2


def http(url: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = token
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


HTTP_CASES = [("/v1/models", None), ("/v1/models/tiny-target", None),
              ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})]


@pytest.mark.ray
@pytest.mark.parametrize("path,body", HTTP_CASES, ids=[p for p, _ in HTTP_CASES])
def test_http_v1_needs_the_token(auth_app, http_base, path, body):  # noqa: F811
    url = f"{http_base}{AUTH_PREFIX}{path}"
    for token in (None, "Bearer wrong", TOKEN):
        status, headers, reply = http(url, body, token)
        assert status == 401 and headers.get("www-authenticate", headers.get("WWW-Authenticate")) == "Bearer"
        assert reply["error"]["code"] == "invalid_api_key" and reply["error"]["type"] == "invalid_request_error"
    status, _, reply = http(url, body, f"Bearer {TOKEN}")
    assert status == 200, reply


@pytest.mark.ray
def test_http_health_is_exempt_and_openai_client_sends_the_token(auth_app, http_base):  # noqa: F811
    openai = pytest.importorskip("openai")
    assert http(f"{http_base}{AUTH_PREFIX}/health")[0] == 200
    with openai.OpenAI(base_url=f"{http_base}{AUTH_PREFIX}/v1", api_key=TOKEN, max_retries=0, timeout=60) as client:
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with openai.OpenAI(base_url=f"{http_base}{AUTH_PREFIX}/v1", api_key="wrong", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
