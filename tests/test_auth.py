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

from cluster.auth import Unauthenticated, auth_sources, auth_token, authorized, check_header, check_metadata
from cluster.serve_client import Client, build_request
from protos import specinfer_pb2_grpc
from serving_fixtures import (http_base, ray_session, serving, tiny_args, tiny_models)  # noqa: F401  (fixtures)
from settings.config import EngineConfig, ModelConfig, ServerConfig

TOKEN = "s3cret-token"
AUTH_APP, AUTH_PREFIX = "specinfer-auth", "/auth"
MODEL = "tiny-target"


# --- without Ray ------------------------------------------------------------------------------

def _tokens(source) -> tuple[str, ...] | None:
    return None if source is None else source.current()


@pytest.mark.parametrize("environ,expected", [
    ({}, None), ({"SPECINFER_AUTH_TOKEN": ""}, None), ({"SPECINFER_AUTH_TOKEN": TOKEN}, (TOKEN,)),
    ({"SPECINFER_AUTH_TOKEN": f"{TOKEN}, next-token ,"}, (TOKEN, "next-token")), ({"OTHER": TOKEN}, None)])
def test_auth_is_on_only_when_the_env_var_is_set(environ, expected):
    assert _tokens(auth_token(ServerConfig(), environ)) == expected
    assert auth_token(ServerConfig(auth_token_env=None), {"SPECINFER_AUTH_TOKEN": TOKEN}) is None
    assert _tokens(auth_token(ServerConfig(auth_token_env="OTHER"), {"OTHER": TOKEN})) == (TOKEN,)


@pytest.mark.parametrize("server,environ,said", [
    (ServerConfig(), {"SPECINFER_AUTH_TOKEN": TOKEN}, "$SPECINFER_AUTH_TOKEN"),
    (ServerConfig(auth_token_file="/etc/specinfer/auth/tokens"), {}, "/etc/specinfer/auth/tokens"),
    (ServerConfig(auth_token_file="/t"), {"SPECINFER_AUTH_TOKEN": TOKEN}, "$SPECINFER_AUTH_TOKEN and /t"),
])
def test_the_log_names_where_the_tokens_come_from_never_a_token(server, environ, said):
    assert auth_sources(server, environ) == said and TOKEN not in said


def _secret_volume(tmp_path, tokens: str, version: int):
    """Write ``tokens`` the way the kubelet updates a Secret volume (AtomicWriter): the key is a symlink
    into ``..data``, itself a symlink swapped in one rename to a new timestamped directory."""
    import os

    data = tmp_path / f"..2026_12_06_{version}"
    data.mkdir()
    (data / "tokens").write_text(tokens)
    (tmp_path / "..data_tmp").symlink_to(data.name)
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    if not (tmp_path / "tokens").is_symlink():
        (tmp_path / "tokens").symlink_to("..data/tokens")
    return tmp_path / "tokens"


def test_token_file_rotation_needs_no_restart(tmp_path):
    """A Secret rotated in place: the old token works until it leaves the file, the new one from when
    it enters; checked per request on the same TokenSource (no restart, no new object)."""
    path = _secret_volume(tmp_path, "old-token\n", 1)
    source = auth_token(ServerConfig(auth_token_file=str(path)), {})
    check_metadata((("authorization", "Bearer old-token"),), source)
    with pytest.raises(Unauthenticated, match="invalid"):
        check_metadata((("authorization", "Bearer new-token"),), source)
    _secret_volume(tmp_path, "# rotating: both accepted\nnew-token\nold-token\n", 2)
    for token in ("old-token", "new-token"):
        check_metadata((("authorization", f"Bearer {token}"),), source)
        check_header(f"Bearer {token}", source)
    _secret_volume(tmp_path, "new-token\n", 3)
    check_metadata((("authorization", "Bearer new-token"),), source)
    with pytest.raises(Unauthenticated, match="invalid"):
        check_header("Bearer old-token", source)


def test_token_file_rewritten_in_place_is_read_again(tmp_path):
    import os

    path = tmp_path / "tokens"
    path.write_text("first-token")
    source = auth_token(ServerConfig(auth_token_file=str(path)), {})
    assert source.current() == ("first-token",)
    path.write_text("second-token")  # same inode; another size and mtime
    os.utime(path, ns=(1, 1))  # a distinct mtime even on a coarse clock
    assert source.current() == ("second-token",)


def test_token_file_is_read_once_per_change(tmp_path, monkeypatch):
    from pathlib import Path

    path = tmp_path / "tokens"
    path.write_text("a-token")
    source = auth_token(ServerConfig(auth_token_file=str(path)), {})
    reads = []
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self) or real(self, *a, **k))
    for _ in range(5):
        check_header("Bearer a-token", source)
    assert reads == [path]  # then a stat per request only


def test_missing_token_file_refuses_every_request_but_the_environments(tmp_path):
    path = tmp_path / "absent"
    source = auth_token(ServerConfig(auth_token_file=str(path)), {})
    assert source is not None and source.current() == ()  # auth stays on: fail closed
    with pytest.raises(Unauthenticated, match="no bearer token is accepted now"):
        check_header("Bearer anything", source)
    with_env = auth_token(ServerConfig(auth_token_file=str(path)), {"SPECINFER_AUTH_TOKEN": TOKEN})
    check_header(f"Bearer {TOKEN}", with_env)
    path.write_text("late-token\n")
    assert with_env.current() == (TOKEN, "late-token")
    with pytest.raises(Unauthenticated, match="missing"):
        check_header(None, with_env)


def test_any_of_several_tokens_matches_and_all_are_compared(monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(b) or real(a, b))
    assert authorized("Bearer second", ("first", "second", "third"))
    assert calls == [b"first", b"second", b"third"]  # no early exit on the match
    assert not authorized("Bearer fourth", ("first", "second", "third"))
    assert not authorized("Bearer first", ())


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
def token_dir(tmp_path_factory):
    """The replica's token file, laid out as a mounted Kubernetes Secret (rewritten by the rotation test)."""
    path = tmp_path_factory.mktemp("auth-secret")
    _secret_volume(path, "file-token-1\n", 0)
    return path


@pytest.fixture(scope="module")
def auth_app(serving, tiny_args, token_dir):  # noqa: F811
    """The tiny app again as ``specinfer-auth`` with SPECINFER_AUTH_TOKEN set in its replica and a
    token file (server.auth_token_file) beside it."""
    from ray import serve

    from cluster.serve_app import SpecInferIngress

    server = {**tiny_args.get("server", {}), "auth_token_file": str(token_dir / "tokens")}
    config = EngineConfig.model_validate({**tiny_args, "server": server})
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


@pytest.mark.ray
def test_served_token_file_rotates_without_a_restart(auth_app, token_dir):
    """The running replica follows its token file: a rotated token is accepted and the dropped one
    refused on the next request, while the environment's token keeps working."""
    bearer = lambda token: (("authorization", f"Bearer {token}"),)  # noqa: E731
    assert grpc_code(auth_app, bearer("file-token-1"), streaming=False) == "OK"
    assert grpc_code(auth_app, bearer("file-token-2"), streaming=False) == "UNAUTHENTICATED"
    _secret_volume(token_dir, "file-token-2\n", 1)
    assert grpc_code(auth_app, bearer("file-token-2"), streaming=True) == "OK"
    assert grpc_code(auth_app, bearer("file-token-1"), streaming=False) == "UNAUTHENTICATED"
    assert grpc_code(auth_app, bearer(TOKEN), streaming=False) == "OK"


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
