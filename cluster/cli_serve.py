"""`specinfer serve`, `specinfer client` and `specinfer demo`: the gRPC service from the shell."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .cli_generate import add_sampling_arguments
from .local_ray import start_local_ray
from settings.config import APP_NAME, EngineConfig, engine_section, read_yaml

DEFAULT_SERVE_CONFIG = "configs/serve.yaml"
logger = logging.getLogger(__name__)


def add_parsers(subparsers) -> None:
    srv = subparsers.add_parser("serve", help="start a local Ray cluster and the gRPC service; Ctrl-C stops it")
    add_server_arguments(srv)
    srv.set_defaults(handler=run_serve)

    cli = subparsers.add_parser("client", help="send one request to a running service")
    cli.add_argument("--address", default="127.0.0.1:9000", help="gRPC HOST:PORT (default %(default)s)")
    add_request_arguments(cli)
    cli.set_defaults(handler=run_client)

    demo = subparsers.add_parser("demo", help="start the service in the background, ask one question, stop it")
    add_server_arguments(demo)
    add_request_arguments(demo)
    demo.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the models to load")
    demo.add_argument("--keep-running", action="store_true", help="leave the server running afterwards")
    demo.set_defaults(handler=run_demo)


def add_server_arguments(parser) -> None:
    parser.add_argument("--config", default=DEFAULT_SERVE_CONFIG, help="Ray Serve config (default %(default)s)")
    parser.add_argument("--grpc-port", type=int, default=None, help="override grpc_options.port")
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster instead of starting a local one on 127.0.0.1")
    parser.add_argument("--num-cpus", type=float, default=None, help="logical CPUs of the local Ray node")
    parser.add_argument("--object-store-mb", type=int, default=None, help="cap the local object store")
    parser.add_argument("--no-batching", action="store_true",
                        help="serve each request with its own forwards (server.batching.enabled: false)")
    parser.add_argument("--no-engine-loop", action="store_true",
                        help="a step loop per request instead of one engine loop per replica for all of them "
                             "(server.engine_loop: false)")


def add_request_arguments(parser) -> None:
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="send the prompt as one user message (chat template)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--mode", choices=["incremental", "sequence", "tree"], default=None)
    parser.add_argument("--expansion", default=None, help="expansion schedule, e.g. 2,2,1")
    parser.add_argument("--ssm", action="append", default=[], help="SSM name to use (repeatable; default all)")
    parser.add_argument("--stream", action="store_true", help="print text as it is verified")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object: text, token_ids, finish_reason, stats")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
    parser.add_argument("--wait-ready", type=float, default=0.0, metavar="SECONDS",
                        help="first wait up to SECONDS for the service to report SERVING")
    add_sampling_arguments(parser)


# --- server -------------------------------------------------------------------------------


def load_serve_config(path: str | Path, grpc_port: int | None = None, no_batching: bool = False,
                      no_engine_loop: bool = False) -> dict:
    """A Serve config file as a dict (validated like `serve run` does), with an optional port,
    continuous batching or the engine loop switched off, on request."""
    from ray.serve.schema import ServeDeploySchema

    data = read_yaml(path)
    if grpc_port is not None:
        data.setdefault("grpc_options", {})["port"] = grpc_port
    if no_batching:
        args = engine_section(data, path)
        args.setdefault("server", {}).setdefault("batching", {})["enabled"] = False
    if no_engine_loop:
        engine_section(data, path).setdefault("server", {})["engine_loop"] = False
    ServeDeploySchema.model_validate(data)
    return data


def deploy(serve_config: dict) -> str:
    """Start Serve with the config's proxy options and deploy its applications; wait until they run.

    Returns the gRPC address. Uses the public serve.start / serve.run, so the config is the one
    `serve run` accepts; application builders get the application's ``args``.
    """
    from ray import serve
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config)
    serve.start(proxy_location=schema.proxy_location, http_options=schema.http_options.model_dump(),
                grpc_options=gRPCOptions(**schema.grpc_options.model_dump()))
    for app in schema.applications:
        target = _import_attr(app.import_path)
        application = target if isinstance(target, serve.Application) else target(app.args or {})
        overrides = [deployment.model_dump(exclude_unset=True) for deployment in app.deployments]
        serve.run(with_deployment_options(application, overrides), name=app.name, route_prefix=app.route_prefix,
                  blocking=False)
    return f"127.0.0.1:{schema.grpc_options.port}"


def with_deployment_options(application, overrides: list[dict]):
    """``application`` with the options of its ``applications[].deployments[]`` entries, in Serve's
    own keys (``num_replicas``, ``autoscaling_config``, ``max_ongoing_requests``, ...), as `serve run`
    and KubeRay's serveConfigV2 apply them. Each entry names the deployment it sets, e.g.
    ``{"name": "SpecInferIngress", "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}``."""
    from ray.serve.deployment import Application

    deployment = application._bound_deployment  # our applications are one deployment
    for override in overrides:
        options = dict(override)
        name = options.pop("name", None)
        if name != deployment.name:
            raise ValueError(f"applications[].deployments[].name is {name!r}, but the application's deployment is "
                             f"{deployment.name!r}")
        deployment = deployment.options(**options)
    return Application(deployment)


def _import_attr(path: str):
    module, _, attr = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), attr)


def drain_serving(timeout_s: float, application: str = APP_NAME) -> int:
    """Ask the ingress to drain (new requests get UNAVAILABLE) and wait up to ``timeout_s`` for the
    running ones to finish. Returns how many still ran. Reaches one replica: `specinfer serve`
    runs one; Serve's graceful shutdown covers the others (cluster.serve_app.app_builder)."""
    from ray import serve

    return serve.get_app_handle(application).drain.remote(timeout_s).result(timeout_s=timeout_s + 30.0)


def stop_serving() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def run_serve(args) -> int:
    serve_config = load_serve_config(args.config, args.grpc_port, args.no_batching, args.no_engine_loop)
    apps = [a.get("name") for a in serve_config.get("applications", [])]
    if APP_NAME not in apps:
        raise ValueError(f"{args.config}: no application named {APP_NAME!r} (found {apps})")
    drain_s = EngineConfig.model_validate(engine_section(serve_config, args.config)).server.drain_timeout_s
    object_store = args.object_store_mb * 2**20 if args.object_store_mb else None
    start_local_ray(args.ray_address, args.num_cpus, object_store)
    # After ray.init, which installs a SIGTERM handler of its own (the driver exits at once, no drain).
    received = _stop_signals()
    try:
        address = deploy(serve_config)
        if received:  # its exception was raised inside serve.run, which swallowed it
            raise received[0]()
        print(f"specinfer: serving gRPC specinfer.v1.SpecInfer on {address} (application {APP_NAME!r}; "
              "Ray Serve's gRPC proxy listens on all interfaces); Ctrl-C stops", flush=True)
        while True:
            time.sleep(1.0)
    except Terminated:
        print(f"specinfer: SIGTERM: draining (up to {drain_s:g} s, server.drain_timeout_s)", flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM does not cut the drain short
        left = drain_serving(drain_s)
        print(f"specinfer: drained ({left} requests still running); stopping", flush=True)
    except KeyboardInterrupt:
        print("specinfer: stopping", flush=True)
    finally:
        stop_serving()
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM: refuse new requests and let running ones finish (``drain``), then stop. Ctrl-C skips
    the drain; Serve's shutdown still waits for running requests (graceful_shutdown_timeout_s)."""


def _stop_signals() -> list[type[KeyboardInterrupt]]:
    """SIGINT raises KeyboardInterrupt and SIGTERM ``Terminated``, as usual, and each is also
    recorded in the returned list: a signal that comes while ``serve.run`` waits for the
    application to start can be swallowed there (a demo's Ctrl-C sent as soon as the gRPC health
    said SERVING, before ``serve.run`` returned, left the server running until it was killed)."""
    exceptions = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Terminated}
    received: list[type[KeyboardInterrupt]] = []

    def raise_it(signum, frame) -> None:
        received.append(exceptions[signum])
        raise exceptions[signum]

    for signum in exceptions:
        signal.signal(signum, raise_it)
    return received


# --- client -------------------------------------------------------------------------------


def request_from_args(args):
    from .serve_client import build_request

    expansion = [int(k) for k in args.expansion.split(",")] if args.expansion else []
    return build_request(
        None if args.chat else args.prompt, [("user", args.prompt)] if args.chat else (),
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop, mode=args.mode, expansion=expansion, ssms=args.ssm, children=args.children,
        adaptive=args.adaptive, prefetch=args.prefetch)


def call(address: str, args) -> dict:
    """Send the request the arguments describe; stream text to stdout unless --json. Returns the result."""
    from .serve_client import Client, response_dict

    request = request_from_args(args)
    with Client(address) as client:
        if args.wait_ready:
            client.wait_ready(args.wait_ready)
        if not args.stream:
            return response_dict(client.generate(request, args.timeout))
        text, ids, last = [], [], None
        for chunk in client.stream(request, args.timeout):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            last = chunk
            if not args.json:
                print(chunk.text, end="", flush=True)
        if not args.json:
            print()
        result = response_dict(last)
        return {**result, "text": "".join(text), "token_ids": ids}


def print_result(result: dict, as_json: bool, streamed: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    if not streamed:
        print(result["text"])
    s = result["stats"]
    print(f"[{s['mode']}] {s['new_tokens']} tokens in {s['target_steps']} target steps "
          f"({result['finish_reason']}): {s['tokens_per_step']:.2f} tokens/step, {s['ms_per_token']:.1f} ms/token "
          f"(draft {s['draft_ms']:.0f} ms, verify {s['verify_ms']:.0f} ms); accepted per SSM "
          f"{s['accepted_per_ssm']}, per depth {s['accepted_per_depth']}", file=sys.stderr)


def run_client(args) -> int:
    import grpc

    try:
        result = call(args.address, args)
    except grpc.RpcError as error:
        print(f"specinfer client: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except TimeoutError as error:
        print(f"specinfer client: {error}", file=sys.stderr)
        return 1
    print_result(result, args.json, args.stream)
    return 0


# --- demo ---------------------------------------------------------------------------------


def server_command(args) -> list[str]:
    command = [sys.executable, "-m", "cluster.cli", "serve", "--config", args.config]
    for flag, value in (("--grpc-port", args.grpc_port), ("--ray-address", args.ray_address),
                        ("--num-cpus", args.num_cpus), ("--object-store-mb", args.object_store_mb)):
        if value is not None:
            command += [flag, str(value)]
    return command + (["--no-batching"] if args.no_batching else []) + (["--no-engine-loop"] if args.no_engine_loop else [])


def run_demo(args) -> int:
    """Start `specinfer serve` in the background, wait until SERVING, send one request, report."""
    port = args.grpc_port or load_serve_config(args.config)["grpc_options"].get("port", 9000)
    address = f"127.0.0.1:{port}"
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"specinfer-serve-{port}.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(server_command(args), stdout=log, stderr=subprocess.STDOUT)
    print(f"specinfer demo: server pid {server.pid}, log {log_path}; waiting for {address} ...", file=sys.stderr)
    try:
        _wait_for_server(address, server, args.ready_timeout)
        code = run_client(argparse.Namespace(**{**vars(args), "address": address, "wait_ready": 0.0}))
    except (TimeoutError, RuntimeError) as error:
        print(f"specinfer demo: {error}; see {log_path}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    if args.keep_running and code == 0:
        print(f"specinfer demo: server still running on {address}; stop it with: kill -INT {server.pid}",
              file=sys.stderr)
        return code
    _stop_process(server)
    return code


def _wait_for_server(address: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Wait until the service reports SERVING; fail early if the server process exits."""
    from .serve_client import Client

    deadline = time.monotonic() + timeout_s
    with Client(address) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with code {process.returncode}")
            try:
                client.wait_ready(min(5.0, max(0.1, deadline - time.monotonic())))
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise


def _stop_process(process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGINT (the server shuts Serve and Ray down cleanly), then SIGKILL if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    print(f"specinfer demo: server stopped (exit {process.returncode})", file=sys.stderr)
