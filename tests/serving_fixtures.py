"""Fixtures for the serving tests: tiny random models on disk and one Ray Serve app per session.

Imported by tests/test_serving.py (``from serving_fixtures import *``-style explicit imports);
nothing here is collected as a test.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Values made once per session. pytest registers these fixtures once per test module that imports
# them, so "session" scope alone would build the models and deploy Serve once per module.
_SESSION: dict = {}

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>"]
CONTEXT = 512


def save_tokenizer(directory: Path):
    """A byte-level tokenizer with no merges: every byte is a token, any text round-trips.

    No EOS token, so generation always runs to max_new_tokens (deterministic lengths).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.save_pretrained(directory)
    return tokenizer


def save_tiny_llama(directory: Path, vocab_size: int, hidden: int, layers: int, heads: int, seed: int) -> None:
    """A random Llama in fp32. A large init spreads the logits, so greedy argmax has no near-ties."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=CONTEXT, initializer_range=0.2, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(directory)


def make_tiny_models(root: Path) -> dict[str, Path]:
    """Target (2 layers) and an independent SSM (1 layer), each with the same byte tokenizer."""
    paths = {"target": root / "tiny-target", "ssm-a": root / "tiny-ssm-a"}
    for path in paths.values():
        path.mkdir(parents=True, exist_ok=True)
    vocab_size = len(save_tokenizer(paths["target"]))
    save_tokenizer(paths["ssm-a"])
    save_tiny_llama(paths["target"], vocab_size, hidden=64, layers=2, heads=4, seed=1)
    save_tiny_llama(paths["ssm-a"], vocab_size, hidden=32, layers=1, heads=2, seed=2)
    return paths


def engine_args(paths: dict[str, Path], **server) -> dict:
    """Engine config (the Serve app's args): two SSMs (an independent tiny model and the target's
    first layer) plus the suffix proposer; small fractional actors with one torch thread each."""
    actor = {"num_cpus": 0.25, "torch_threads": 1, "max_concurrency": 8}
    return {
        "models_dir": str(paths["target"].parent), "dtype": "float32", "torch_threads": 1,
        "target": {"name": "tiny-target", "source": str(paths["target"])},
        "ssms": [{"name": "ssm-a", "source": str(paths["ssm-a"])},
                 {"name": "ssm-b", "source": str(paths["target"]), "num_layers": 1}],
        # No global store: served output is compared with the in-process engine step for step, and the
        # store's contents would depend on which requests each side ran before.
        "suffix": {"name": "suffix", "max_cached_requests": 0},
        # Fixed shapes: cost-aware ones follow timings, which differ between the two sides (the served
        # cost-aware path has its own test).
        "speculation": {"mode": "tree", "policy": "schedule", "expansion": [2, 2, 1], "max_tree_nodes": 32},
        "defaults": {"max_new_tokens": 24},
        "verifier": {"actor": actor},
        "server": {"max_concurrent_requests": 2, "max_new_tokens_limit": 400, "request_ttl_s": 600.0,
                   "ssm_actor": actor, "merge_actor": {**actor, "num_cpus": 0.1},
                   # 1152 tokens: two lanes of 400-token requests fit (a 110-token prompt, 400 new tokens
                   # and a 52-node tree reserve 562); the admission tests fill the pool on purpose
                   "batching": {"kv_cache_tokens": 1152, "admission_timeout_s": 2.0},
                   # The budget comes from a timed verify-cost curve, so it varies with the machine's load;
                   # served output is compared with the in-process engine (no budget), step for step.
                   "tree_budget": {"enabled": False},
                   # the engine loop queues nothing here: a third request is refused, as the tests expect
                   # (tests/test_served_loop.py has an app with a queue)
                   "max_waiting_requests": 0, **server},
    }


def wait_until(predicate, timeout_s: float = 15.0, poll_s: float = 0.1) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


@contextmanager
def batch_hold(set_hold: Callable[[int], object], count: int) -> Iterator[None]:
    """The next packed forward waits for ``count`` requests inside the block; the hold is always
    lifted at its end (``set_hold(0)``), so a failing test cannot leave every later request on a
    shared engine or app frozen. ``set_hold``: a batcher's ``hold_next`` or ``remote_hold(actor)``."""
    set_hold(count)
    try:
        yield
    finally:
        set_hold(0)


@contextmanager
def loop_hold(actor, tmp_dir: Path) -> Iterator[None]:
    """An actor's engine-loop calls wait inside the block: a call of the test's holds its
    ``loop_lock`` (``actors.common.HoldsRequests``) until the block ends (at most 300 s). An actor
    killed inside the block takes the hold with it."""
    import ray

    release = tmp_dir / f"release-{time.monotonic_ns()}"

    def hold(held, path: str) -> None:  # local: Ray pickles it by value
        import os
        import time

        with held.loop_lock:
            deadline = time.monotonic() + 300
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.01)

    holding = actor.__ray_call__.remote(hold, str(release))
    try:
        assert wait_until(lambda: ray.get(actor.__ray_call__.remote(lambda held: held.loop_lock.locked())),
                          timeout_s=60), "the hold never took the actor's loop lock"
        yield
    finally:
        release.touch()
        try:
            ray.get(holding, timeout=60)
        except ray.exceptions.RayActorError:  # killed by the test
            pass


def remote_hold(verifier) -> Callable[[int], None]:
    """A verifier actor's ``hold_next_batch`` as a blocking call (for ``batch_hold``)."""
    import ray

    return lambda count: ray.get(verifier.hold_next_batch.remote(count), timeout=60)


@contextmanager
def own_app(serving: str, args: dict, name: str, route_prefix: str, deployments: list[dict] = ()):
    """An application next to the shared one, for one module, deleted at the end: (a gRPC client
    on it, its Serve handle, the HTTP base URL of its routes). ``deployments``: Serve's options for
    the ingress deployment, as in a Serve config's ``applications[].deployments[]``."""
    from ray import serve
    from ray.serve.context import _get_global_client

    from cluster.cli_serve import with_deployment_options
    from cluster.serve_app import app_builder
    from cluster.serve_client import Client

    serve.run(with_deployment_options(app_builder(args), list(deployments)), name=name, route_prefix=route_prefix,
              blocking=False)
    http = _get_global_client().http_config
    try:
        with Client(serving, application=name) as client:
            client.wait_ready(300)
            yield client, serve.get_app_handle(name), f"http://{http.host}:{http.port}{route_prefix}"
    finally:
        serve.delete(name, _blocking=False)  # its own wait polls once a second
        assert wait_until(lambda: name not in serve.status().applications, timeout_s=120), f"{name} not deleted"


def http_health(url: str) -> tuple[int, str]:
    """(HTTP status, the body's "status") of the replica's GET /health."""
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, json.load(reply)["status"]
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)["status"]


def serve_config(args: dict, grpc_port: int, http_port: int) -> dict:
    """configs/serve.yaml with the test's engine args and ports, on one replica (its deployment
    options, such as autoscaling, left out: tests/test_scale.py scales an application of its own)."""
    from cluster.cli_serve import load_serve_config

    config = load_serve_config(Path(__file__).resolve().parent.parent / "configs" / "serve.yaml")
    config["http_options"]["port"] = http_port
    config["grpc_options"]["port"] = grpc_port
    config["applications"][0]["args"] = args
    config["applications"][0].pop("deployments", None)
    return config


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if "tiny_models" not in _SESSION:
        _SESSION["tiny_models"] = make_tiny_models(tmp_path_factory.mktemp("tiny-models"))
    return _SESSION["tiny_models"]


@pytest.fixture(scope="session")
def tiny_args(tiny_models) -> dict:
    return engine_args(tiny_models)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray node on 127.0.0.1 with a capped object store, or the one another module started.

    Yields True when these fixtures started Ray (the first instance shuts it down at the end).
    """
    import ray

    from cluster.local_ray import start_local_ray

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # Workers push metrics to the node's agent every second (default 10 s): tests/test_metrics.py
    # reads them from the metrics endpoint. Read by the raylet and workers at start.
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    owns = not ray.is_initialized()
    if owns:
        start_local_ray(num_cpus=4, object_store_memory=200 * 2**20)
        _SESSION["started_ray"] = True
    yield owns or _SESSION.get("started_ray", False)
    if owns:
        _SESSION.pop("started_ray", None)
        ray.shutdown()


@pytest.fixture(scope="session")
def serving(ray_session, tiny_args):
    """Serve + the specinfer app on tiny models, once per session; yields the gRPC address."""
    from ray import serve

    from cluster.cli_serve import deploy
    from cluster.local_ray import free_port
    from cluster.serve_client import Client

    if "serving" in _SESSION:  # deployed for another test module of this session
        yield _SESSION["serving"]
        return
    try:
        address = deploy(serve_config(tiny_args, free_port(), free_port()))
        with Client(address) as client:
            client.wait_ready(120)
        _SESSION["serving"] = address
        yield address
    finally:
        _SESSION.pop("serving", None)
        serve.shutdown()


@pytest.fixture(scope="session")
def ingress(serving):
    """A Serve handle on the ingress deployment (for num_active() and actors())."""
    from ray import serve

    return serve.get_app_handle("specinfer")


@pytest.fixture(scope="session")
def http_base(serving) -> str:
    """The Serve HTTP proxy's base URL (the OpenAI routes live under /v1 of it)."""
    from ray.serve.context import _get_global_client

    options = _get_global_client().http_config
    return f"http://{options.host}:{options.port}"


@pytest.fixture(scope="session")
def metrics_url(ray_session) -> str:
    """The local Ray node's Prometheus endpoint (its metrics agent on the metrics export port)."""
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    if not port:  # joined an existing node: ask the GCS
        port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    return f"http://127.0.0.1:{port}/metrics"


@pytest.fixture(scope="session")
def local_engine(tiny_args):
    """The in-process engine on the same config (the reference for every served output)."""
    from cluster.build import build_engine
    from settings.config import EngineConfig

    if "local_engine" not in _SESSION:
        _SESSION["local_engine"] = build_engine(EngineConfig.model_validate(tiny_args))
    return _SESSION["local_engine"]
