"""`specinfer serve` and `specinfer demo` as processes: what a SIGTERM (Kubernetes' stop, `kill`)
does to the server, and the demo's one question on the tiny models."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from serving_fixtures import local_engine, serve_config, tiny_args, tiny_models  # noqa: F401 (fixtures)
from test_serving import PROMPTS, local_result

ROOT = Path(__file__).resolve().parents[1]

# run_serve with Serve's deploy and drain stubbed: the Ray node it starts, the signal handling and the
# shutdown are the real ones. The drain itself (UNAVAILABLE for new requests, running streams
# finished, NOT_SERVING) is served in tests/test_load.py, and the real server process (deploy, Ray,
# Serve, shutdown) runs in the demo test below. The stub reports what the server passed it and
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


# A deploy that receives the signal while it waits and swallows the exception it raises, as
# serve.run can while it waits for the application to start.
SWALLOWING_DEPLOY = textwrap.dedent("""
    import os, signal, time
    def swallowing_deploy(config):
        try:
            os.kill(os.getpid(), signal.{name})
            time.sleep(5)
        except BaseException:
            print("deploy swallowed it", flush=True)
        return "127.0.0.1:0"
    cli.deploy = swallowing_deploy
""")


@pytest.mark.ray
@pytest.mark.parametrize("name, events", [
    ("SIGINT", ["deploy swallowed it", "specinfer: stopping"]),
    ("SIGTERM", ["deploy swallowed it", "specinfer: SIGTERM: draining", "drain called", "specinfer: drained"]),
])
def test_a_signal_during_deploy_still_stops_the_server(name, events):
    """A Ctrl-C or SIGTERM that comes before deploy returns stops the server once deploy returns, even
    where deploy swallowed its exception (a demo's Ctrl-C sent as soon as the health said SERVING,
    before serve.run returned, once left the server running until it was killed)."""
    script = SERVER.replace("sys.exit(cli.run_serve(args))", SWALLOWING_DEPLOY.replace("{name}", name)
                            + "sys.exit(cli.run_serve(args))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_server_env(), text=True,
                          capture_output=True, timeout=300)  # a hang guard, not a speed bound
    output = done.stdout + done.stderr
    seen = [next(e for e in events if line.startswith(e))
            for line in output.splitlines() if line.startswith(tuple(events))]
    assert seen == events and "specinfer: serving" not in output, output[-3000:]
    assert done.returncode == 0, output[-3000:]


def serve_drain_timeout_s() -> float:
    """server.drain_timeout_s of configs/serve.yaml (what `specinfer serve` runs)."""
    from cluster.cli_serve import load_serve_config
    from settings.config import EngineConfig, engine_section

    path = ROOT / "configs" / "serve.yaml"
    return EngineConfig.model_validate(engine_section(load_serve_config(path), path)).server.drain_timeout_s


def port_closed(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def processes_naming(text: str) -> list[str]:
    """Command lines of the running processes that contain ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # not a process, or it ended meanwhile
            continue
        if text in command:
            found.append(command)
    return found


@pytest.mark.ray
def test_demo_prints_the_answer_and_leaves_nothing_running(tiny_args, local_engine, tmp_path, capsys,  # noqa: F811
                                                           monkeypatch):
    """`specinfer demo` (scripts/main.sh) on a Serve config of the tiny models: it starts `specinfer
    serve` in the background, prints the answer (the in-process engine's on the same config), and
    stops the server: its process has exited, its ports are closed and no process of its Ray node
    is left (each names the node's temporary directory, RAY_TMPDIR)."""
    import yaml

    from cluster.cli import main
    from cluster.local_ray import free_port

    grpc_port, http_port = free_port(), free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(serve_config(tiny_args, grpc_port, http_port)))
    ray_tmp = tempfile.mkdtemp(prefix="ray-demo-", dir="/tmp")  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # its own node, not the session's
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the demo writes the server's log
    _, expected = local_result(local_engine, tiny_args, PROMPTS[0], max_new_tokens=12)
    capsys.readouterr()
    try:
        code = main(["demo", "--config", str(config), "--prompt", PROMPTS[0], "--max-new-tokens", "12", "--json",
                     "--num-cpus", "2", "--ready-timeout", "300"])
        out, err = capsys.readouterr()
        left = processes_naming(ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert code == 0, err
    answer = json.loads(out.strip().splitlines()[-1])
    assert answer["token_ids"] == list(expected.token_ids) and answer["text"] == expected.text
    assert answer["finish_reason"] == "length" and answer["stats"]["new_tokens"] == 12
    server = int(re.search(r"server pid (\d+)", err).group(1))
    assert "server stopped (exit 0)" in err, err
    # stopped by its Ctrl-C path (the demo's SIGINT), which shuts Serve and Ray down
    assert "specinfer: stopping" in (tmp_path / f"specinfer-serve-{grpc_port}.log").read_text().splitlines()
    assert not Path(f"/proc/{server}").exists()  # exited, and reaped by the demo
    assert port_closed(grpc_port) and port_closed(http_port)
    assert left == []
