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
# shutdown are the real ones.
SERVER = textwrap.dedent("""
    import argparse, sys
    import cluster.cli_serve as cli
    cli.deploy = lambda config: "127.0.0.1:0"
    cli.drain_serving = lambda timeout_s: print(f"drain called ({timeout_s:g} s)", flush=True) or 0
    args = argparse.Namespace(config="configs/serve.yaml", grpc_port=None, no_batching=False, engine_loop=False,
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
    assert "specinfer: SIGTERM: draining" in output, output[-3000:]
    assert "drain called" in output and "drained (0 requests still running); stopping" in output, output[-3000:]
    assert server.returncode == 0, output[-3000:]
