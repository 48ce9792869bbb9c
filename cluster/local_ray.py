"""Start a local Ray node bound to loopback, or join a running cluster.

Used by ``specinfer serve``, by ``cluster.build`` (a tensor-parallel target in ``specinfer
generate`` / ``bench``) and by the tests. Example::

    start_local_ray()                              # a private node on 127.0.0.1
    start_local_ray(os.environ.get("RAY_ADDRESS")) # or join a running cluster
"""

from __future__ import annotations

import os
import socket
import sys


def start_local_ray(address: str | None = None, num_cpus: float | None = None,
                    object_store_memory: int | None = None) -> None:
    """Join ``address``, or start a local node bound to 127.0.0.1 without dashboard or usage stats."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not address:
        _loopback_only()
    import ray

    if address:
        ray.init(address=address)
        return
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=num_cpus,
             object_store_memory=object_store_memory)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a local server's gRPC and HTTP proxies)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_only() -> None:
    """Make a local Ray node advertise (and its servers bind) 127.0.0.1 only.

    Ray 2.60 rewrites ``_node_ip_address="127.0.0.1"`` to the host's routable address
    (``services.resolve_ip_for_localhost``) unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which
    it reads at import: set the variable (the raylet and workers inherit it) and, when ray is
    already imported, its constant. Local runs only: a cluster joined by address is left alone.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False
