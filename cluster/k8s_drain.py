"""`specinfer k8s drain-node`: the worker pods' preStop hook. Drain this pod's Ray node, then wait.

Kubernetes runs a container's preStop hook before it sends SIGTERM, within the pod's
terminationGracePeriodSeconds (render: server.drain_timeout_s + 30 s). Without it, SIGTERM stops
the raylet at once and every request running on the node's ingress replicas fails. The hook asks
the GCS to drain the node (DrainNode, reason PREEMPTION, which the raylet cannot refuse, with a
deadline ``--deadline-s`` away; what `ray drain-node` and autoscaler v2 send). Ray Serve 2.60 then
(ray/serve/_private: ``cluster_node_info_cache``, ``DeploymentState.migrate_replicas_on_draining_nodes``,
``ProxyStateManager``):

* starts replacements for the node's replicas on other nodes where resources allow, and stops the
  node's replicas gracefully: no new requests are routed to them, running ones get
  ``graceful_shutdown_timeout_s`` (= server.drain_timeout_s, ``cluster.serve_app.app_builder``) to
  finish. A replica is stopped once its replacement runs, or at the latest when the deadline
  minus that timeout has come (at once here, as the deadline is the drain timeout);
* drains the node's proxy: its ``/-/healthz`` fails, so KubeRay's readiness probe takes the pod out
  of the serving Service while the proxy finishes what it carries.

The raylet exits by itself once it is draining and idle (``LocalResourceManager::
OnResourceOrStateChanged``): the replica's verifier, SSM and merge actors die with it. The hook
returns when the GCS reports the node dead, or after ``--wait-s``; SIGTERM then finds nothing
running. A GCS that cannot be reached (the whole cluster is being deleted) ends the hook at once.

Ray 2.60's own SIGTERM handler in ``ray start`` drains the node too (``Node._drain_node_before_shutdown``,
RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, default 30 s), but only if the signal reaches that process
(KubeRay runs it under a shell) and within a budget unrelated to server.drain_timeout_s; the hook
does not depend on either. Render sets that variable to what is left of the grace period after the
hook (``STOP_MARGIN_S`` - 5 s), so that the two never add up past it.
Ray's token (RAY_AUTH_MODE / RAY_AUTH_TOKEN, set by KubeRay with authOptions) is in the container's
environment, which the hook inherits.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Protocol

REASON_MESSAGE = "Kubernetes is stopping this pod (preStop: specinfer k8s drain-node)"
GCS_TIMEOUT_S = 10.0
DEAD = 1  # gcs_pb2.GcsNodeInfo.GcsNodeState.DEAD


class Gcs(Protocol):
    """The part of ray._raylet.GcsClient the hook uses."""

    def get_all_node_info(self, timeout=None) -> dict: ...

    def drain_node(self, node_id: bytes, reason: int, reason_message: str, deadline_timestamp_ms: int,
                   timeout=None) -> tuple[bool, str]: ...


def this_node(gcs: Gcs, node_ip: str) -> bytes:
    """The binary id of the live Ray node at ``node_ip`` (this pod: one raylet per pod)."""
    nodes = [info for info in gcs.get_all_node_info(timeout=GCS_TIMEOUT_S).values()
             if info.node_manager_address == node_ip and info.state != DEAD]
    if len(nodes) != 1:
        raise LookupError(f"{len(nodes)} live Ray nodes at {node_ip}; expected this pod's one")
    return nodes[0].node_id


def node_dead(gcs: Gcs, node_id: bytes) -> bool:
    infos = gcs.get_all_node_info(timeout=GCS_TIMEOUT_S).values()
    return not any(info.node_id == node_id and info.state != DEAD for info in infos)


def drain_node(gcs: Gcs, node_ip: str, deadline_s: float, wait_s: float, reason: int, *,
               clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
               poll_s: float = 1.0) -> str:
    """Drain the node at ``node_ip`` with a deadline ``deadline_s`` away; wait up to ``wait_s`` for it
    to die. Returns what happened, one line."""
    node_id = this_node(gcs, node_ip)
    start = clock()
    # The id goes as hex: the GCS decodes it with FromHex, and a binary id becomes the nil id, which it
    # accepts without draining anything (ray/_private/node.py, _drain_node_before_shutdown).
    accepted, why = gcs.drain_node(node_id.hex(), reason, REASON_MESSAGE, int((start + deadline_s) * 1000),
                                   timeout=GCS_TIMEOUT_S)
    if not accepted:
        return f"drain of node {node_id.hex()} refused: {why}"
    while clock() - start < wait_s:
        if node_dead(gcs, node_id):
            return f"node {node_id.hex()} drained and stopped after {clock() - start:.0f} s"
        sleep(poll_s)
    return f"node {node_id.hex()} still alive after {wait_s:g} s: stopping it anyway"


def run_drain_node(args) -> int:
    """The CLI handler: connect to the GCS at $RAY_ADDRESS (KubeRay sets it in every Ray container)."""
    import ray
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        print("specinfer k8s drain-node: no --address and no $RAY_ADDRESS; nothing drained")
        return 1
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    try:
        message = drain_node(GcsClient(address=address), args.node_ip or ray.util.get_node_ip_address(),
                             args.deadline_s, args.wait_s, reason)
    except Exception as error:  # the GCS is gone (cluster deleted) or the node unknown: nothing to wait for
        print(f"specinfer k8s drain-node: {type(error).__name__}: {error}; nothing drained")
        return 1
    print(f"specinfer k8s drain-node: {message}")
    return 0
