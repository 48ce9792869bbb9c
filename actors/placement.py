"""Reserve one ingress replica's actor resources before starting the actors, within a bound.

An actor whose resources the cluster does not have waits for them forever, with only Ray's
"cannot be scheduled right now" warning in the logs. A replica instead reserves every actor's
CPUs and GPUs at once in a placement group (one bundle per actor, soft-packed onto few nodes)
and waits at most ``server.actor_placement_timeout_s``; past it the replica's start fails with
what was missing, which Serve shows in the deployment's status and retries:

    placement = await reserve(replica_demands(config), 300.0, "specinfer/ab12cd34")
    # PlacementFailed: replica specinfer/ab12cd34 could not place its actors within 300 s
    # (server.actor_placement_timeout_s): they need 1.6 CPU (verifier 1, ssm/qwen 0.5, merge 0.1);
    # the cluster has 0.4 of 2 CPU free

The group belongs to the replica (Ray removes it when its creator dies; ``ActorGroup.kill``
removes it sooner), and its actors are scheduled into its bundles (``Placement.options``).
A tensor-parallel verifier's rank actors reserve their own group (``actors.rank_group``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from settings.config import ActorOptions, EngineConfig

logger = logging.getLogger(__name__)

KINDS = ("CPU", "GPU")
TIMEOUT_FIELD = "server.actor_placement_timeout_s"
WARN_AFTER_S = 10.0  # a replica still waiting this long says what for


class PlacementFailed(RuntimeError):
    """The cluster did not free a replica's actor resources within the bound."""


@dataclass(frozen=True)
class Demand:
    """What one actor asks Ray for: its role (``verifier``, ``ssm/<name>``, ``merge``), CPUs, GPUs."""

    role: str
    cpus: float
    gpus: float

    def bundle(self) -> dict[str, float]:
        """Its placement-group bundle: the resources it asks for (empty when none)."""
        return {kind: amount for kind, amount in zip(KINDS, (self.cpus, self.gpus)) if amount > 0}


@dataclass(frozen=True)
class Placement:
    """A reserved placement group and the bundle index of each role that has one."""

    group: object | None  # ray.util.placement_group.PlacementGroup
    bundles: dict[str, int]

    def options(self, role: str) -> dict:
        """Actor options that schedule ``role`` into its bundle ({} for a role without one)."""
        if self.group is None or role not in self.bundles:
            return {}
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=self.bundles[role])}

    def remove(self) -> None:
        if self.group is not None:
            remove_placement_group(self.group)


NO_PLACEMENT = Placement(None, {})  # actors scheduled anywhere (a replica whose actors ask for nothing)


def ssm_role(name: str) -> str:
    return f"ssm/{name}"


def verifier_options(config: EngineConfig) -> ActorOptions:
    """With tensor parallelism the verifier only coordinates: the ranks hold the GPUs and CPUs
    (in a placement group of their own)."""
    options = config.verifier.actor
    if config.verifier.tensor_parallel_size == 1:
        return options
    return options.model_copy(update={"num_cpus": 0.1, "num_gpus": 0.0, "torch_threads": 1})


def replica_demands(config: EngineConfig) -> tuple[Demand, ...]:
    """One replica's actors in launch order: the verifier, one per SSM, the merge actor."""
    verifier, server = verifier_options(config), config.server
    ssms = tuple(Demand(ssm_role(ssm.name), server.ssm_actor.num_cpus, server.ssm_actor.num_gpus)
                 for ssm in config.ssms)
    return (Demand("verifier", verifier.num_cpus, verifier.num_gpus), *ssms,
            Demand("merge", server.merge_actor.num_cpus, server.merge_actor.num_gpus))


async def reserve(demands: tuple[Demand, ...], timeout_s: float, replica: str) -> Placement:
    """Reserve every demand's bundle at once; raise ``PlacementFailed`` naming what is missing
    when the cluster has not granted them within ``timeout_s`` (a warning says so after 10 s)."""
    roles = [demand.role for demand in demands if demand.bundle()]
    if not roles:
        return NO_PLACEMENT
    group = placement_group([d.bundle() for d in demands if d.bundle()], strategy="PACK", name=f"{replica}/actors")
    warning = asyncio.get_running_loop().call_later(WARN_AFTER_S, lambda: logger.warning(
        "replica %s still waits for its actors' resources (gives up after %g s, %s): %s", replica, timeout_s,
        TIMEOUT_FIELD, shortage(demands, ray.available_resources(), node_totals())))
    try:
        await asyncio.wait_for(asyncio.ensure_future(group.ready()), timeout_s)
    except asyncio.TimeoutError:
        missing = shortage(demands, ray.available_resources(), node_totals())
        remove_placement_group(group)
        raise PlacementFailed(f"replica {replica} could not place its actors within {timeout_s:g} s "
                              f"({TIMEOUT_FIELD}): {missing}") from None
    finally:
        warning.cancel()
    return Placement(group, {role: index for index, role in enumerate(roles)})


def node_totals() -> list[dict[str, float]]:
    """Each live node's total resources."""
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def shortage(demands: tuple[Demand, ...], free: dict[str, float], nodes: list[dict[str, float]]) -> str:
    """What ``demands`` ask for against the cluster: per resource kind, what the actors need (and
    which needs what), what the cluster has free of its total, and any actor no single node holds.

    Example: ``shortage((Demand("verifier", 64, 0), Demand("merge", 0.1, 0)), {"CPU": 3.5}, [{"CPU": 4}])``
    -> "they need 64.1 CPU (verifier 64, merge 0.1); the cluster has 3.5 of 4 CPU free; no node
    has 64 CPU for the verifier (the largest has 4)".
    """
    needs, haves, alone = [], [], []
    for kind in KINDS:
        per_role = [(d.role, d.bundle()[kind]) for d in demands if kind in d.bundle()]
        if not per_role:
            continue
        needs.append(f"{sum(a for _, a in per_role):.4g} {kind} ("
                     + ", ".join(f"{role} {amount:.4g}" for role, amount in per_role) + ")")
        total = sum(node.get(kind, 0.0) for node in nodes)
        haves.append(f"{free.get(kind, 0.0):.4g} of {total:.4g} {kind} free")
        largest = max((node.get(kind, 0.0) for node in nodes), default=0.0)
        alone += [f"no node has {amount:.4g} {kind} for the {role} (the largest has {largest:.4g})"
                  for role, amount in per_role if amount > largest]
    return f"they need {' and '.join(needs)}; the cluster has {' and '.join(haves)}" + "".join(
        f"; {line}" for line in alone)
