"""`specinfer serve` as a process: what a SIGTERM (Kubernetes' stop, `kill`) does to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# run_serve with Serve's deploy and drain stubbed: the Ray node it starts, the signal handling and the
# shutdown are the real ones. The drain itself (UNAVAILABLE for new requests, running streams
# finished, NOT_SERVING) is served in tests/test_load.py; deploying the app in this subprocess
# would load models for minutes to test the same. The stub reports what the server passed it and
# whether Ray was still up, and returns 2 requests "still running" for the server to report.
SERVER = textwrap.dedent("""
    import argparse, sys
    import ray
    import cluster.cli_serve as cli
    cli.deploy = lambda config: "127.0.0.1:0"
    cli.drain_serving = lambda timeout_s: print(f"drain called ({timeout_s:g} s, Ray up: {ray.is_initialized()})",
                                                flush=True) or 2
    args = argparse.Namespace(config="configs/serve.yaml", grpc_port=None, no_batching=False, no_engine_loop=False,
                              ray_address=None, num_cpus=1, object_store_mb=None)
    sys.exit(cli.run_serve(args))
""")


def _server_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONUNBUFFERED="1")
    return env


@pytest.mark.ray
def test_sigterm_drains_then_stops_cleanly():
    """ray.init installs a SIGTERM handler of its own; the server's must come after it, or a SIGTERM
    ends the driver at once (Ray's handler aborts it) and running requests are never drained."""
    server = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, env=_server_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    watchdog = threading.Timer(300.0, server.kill)  # a hang guard: reading stdout would block forever
    watchdog.start()
    try:
        for line in server.stdout:
            lines.append(line)
            if line.startswith("specinfer: serving"):
                server.send_signal(signal.SIGTERM)
                break
        rest, _ = server.communicate(timeout=120)  # a hang guard, not a speed bound
    finally:
        watchdog.cancel()
        if server.poll() is None:
            server.kill()
            server.wait()
    output = "".join(lines) + rest
    events = [line.strip() for line in output.splitlines() if line.startswith(("specinfer: SIGTERM", "drain called",
                                                                             "specinfer: drained"))]
    drain_s = serve_drain_timeout_s()
    assert events == [f"specinfer: SIGTERM: draining (up to {drain_s:g} s, server.drain_timeout_s)",
                      f"drain called ({drain_s:g} s, Ray up: True)",
                      "specinfer: drained (2 requests still running); stopping"], output[-3000:]
    assert server.returncode == 0, output[-3000:]


def serve_drain_timeout_s() -> float:
    """server.drain_timeout_s of configs/serve.yaml (what `specinfer serve` runs)."""
    from cluster.cli_serve import load_serve_config
    from settings.config import EngineConfig, engine_section

    path = ROOT / "configs" / "serve.yaml"
    return EngineConfig.model_validate(engine_section(load_serve_config(path), path)).server.drain_timeout_s
