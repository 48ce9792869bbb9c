"""A bench script's own local server: Ray on loopback, the Serve config on free ports, ready.

    address = start_app("configs/serve.yaml", lambda args: {**args, ...}, ready_timeout_s=600)
    ...                                              # stop with cluster.cli_serve.stop_serving()
"""

from __future__ import annotations

from typing import Callable

from cluster.cli_serve import deploy, load_serve_config
from cluster.local_ray import free_port, start_local_ray
from cluster.serve_client import Client
from settings.config import APP_NAME


def start_app(config_path: str, engine_args: Callable[[dict], dict], ready_timeout_s: float,
              grpc_port: int | None = None, num_cpus: float | None = None,
              object_store_memory: int | None = None, deployments: list[dict] | None = None) -> str:
    """Deploy the config with the ``specinfer`` app's args passed through ``engine_args``, on free
    loopback ports (or ``grpc_port``); wait until it is SERVING; its gRPC address. ``deployments``:
    the app's ``deployments`` entries instead of the config's (Serve's options, e.g. autoscaling)."""
    serve_config = load_serve_config(config_path, grpc_port or free_port())
    serve_config["http_options"] = {**serve_config.get("http_options", {}), "port": free_port()}
    app = next(a for a in serve_config["applications"] if a["name"] == APP_NAME)
    app["args"] = engine_args(app.get("args") or {})
    if deployments is not None:
        app["deployments"] = deployments
    start_local_ray(num_cpus=num_cpus, object_store_memory=object_store_memory)
    address = deploy(serve_config)
    with Client(address) as client:
        client.wait_ready(ready_timeout_s)
    return address
