"""Create, check and own the actors of one ingress replica."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray

from settings.config import ActorOptions, EngineConfig

from .detached import call_detached
from .merge import MergeActor
from .placement import NO_PLACEMENT, Placement, replica_demands, reserve, ssm_role, verifier_options
from .ssm import SSMActor
from .verifier import TargetInfo, VerifierActor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActorGroup:
    """Handles to one replica's actors. ``names``: proposers in engine order (SSMs, then suffix);
    ``windows``: each one's ``context_tokens`` (``engine.loop.Executor.windows``)."""

    names: tuple[str, ...]
    neural: tuple[bool, ...]
    windows: tuple[int | None, ...]
    ssms: tuple  # ActorHandle per config.ssms entry
    merge: object  # ActorHandle
    verifier: object  # ActorHandle
    placement: Placement = NO_PLACEMENT  # the reservation they run in (removed with them)

    def everyone(self) -> list:
        return [*self.ssms, self.merge, self.verifier]

    def roles(self) -> dict[str, object]:
        """Handles by role: ``verifier``, ``merge``, ``ssm/<name>`` (the names ``Liveness`` uses)."""
        handles = {"verifier": self.verifier, "merge": self.merge}
        handles.update({ssm_role(name): actor for name, actor in zip(self.names, self.ssms)})
        return handles

    def release(self, request_id: str) -> None:
        """Drop a request's state everywhere; fire and forget.

        Called from the request's ``finally``, which also runs when Serve cancels the request's
        task (the client went away) and with it, recursively, the calls that task sent and that
        have not left yet. Sent in the request's context, the releases would be among them (a race
        a loaded box lost: the state and KV blocks stayed until the TTL sweep); sent detached, they
        are nobody's children.
        """
        call_detached(self._send_releases, request_id)

    def _send_releases(self, request_id: str) -> None:
        for actor in self.everyone():
            try:
                actor.release.remote(request_id)
            except Exception:  # a handle that cannot send: its TTL sweep drops the state
                logger.warning("release of request %s not sent", request_id, exc_info=True)

    def kill(self) -> None:
        try:
            ray.get(self.verifier.shutdown.remote(), timeout=15)
        except Exception:  # a dead or stuck verifier: its ranks die with it
            logger.warning("verifier did not shut down cleanly", exc_info=True)
        for actor in self.everyone():
            ray.kill(actor, no_restart=True)
        self.placement.remove()


def _options(options: ActorOptions, name: str, namespace: str | None) -> dict:
    # Ray starts workers with OMP_NUM_THREADS=1, which the BLAS libraries read once at start-up:
    # give the actor's process the configured thread count from the start.
    threads = str(options.torch_threads)
    return {"name": name, "namespace": namespace, "num_cpus": options.num_cpus, "num_gpus": options.num_gpus,
            "max_restarts": options.max_restarts, "max_concurrency": options.max_concurrency,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}}}


def launch(config: EngineConfig, prefix: str, namespace: str | None = None,
           placement: Placement = NO_PLACEMENT) -> ActorGroup:
    """Start the verifier, one actor per SSM and the merge actor, named ``{prefix}/<role>``, each
    in its bundle of ``placement`` (``actors.placement.reserve``) when it has one.

    Not detached: they belong to the caller (the ingress replica) and die with it.
    """
    server = config.server

    def options(actor: ActorOptions, role: str) -> dict:
        return {**_options(actor, f"{prefix}/{role}", namespace), **placement.options(role)}

    verifier = ray.remote(VerifierActor).options(**options(verifier_options(config), "verifier")).remote(
        config, config.verifier.actor.torch_threads, prefix, namespace)
    ssms = tuple(ray.remote(SSMActor).options(**options(server.ssm_actor, ssm_role(ssm.name)))
                 .remote(config, index, server.ssm_actor.torch_threads) for index, ssm in enumerate(config.ssms))
    merge = ray.remote(MergeActor).options(**options(server.merge_actor, "merge")).remote(
        config.suffix, len(config.ssms), server.merge_actor.torch_threads, server.request_ttl_s)
    return ActorGroup(tuple(config.proposer_names()), tuple(config.proposer_neural()),
                      tuple(config.proposer_windows()), ssms, merge, verifier, placement)


async def start(config: EngineConfig, prefix: str, namespace: str | None = None) -> tuple[ActorGroup, TargetInfo]:
    """Reserve the actors' resources (failing with what is missing after
    server.actor_placement_timeout_s), start them and wait until they are ready; a failed start
    leaves no actor or reservation behind."""
    placement = await reserve(replica_demands(config), config.server.actor_placement_timeout_s, prefix)
    group = launch(config, prefix, namespace, placement)
    try:
        return group, await check_ready(group)
    except BaseException:
        group.kill()
        raise


async def check_ready(group: ActorGroup) -> TargetInfo:
    """Wait for every actor to load; check each SSM shares the target's vocabulary."""
    info: TargetInfo = await group.verifier.ready.remote()
    await group.merge.ready.remote()
    for name, vocabulary in [await actor.ready.remote() for actor in group.ssms]:
        if vocabulary != info.vocabulary:
            raise ValueError(
                f"SSM {name!r} (vocab {vocabulary.size}) does not share the vocabulary of target {info.name!r} "
                f"(vocab {info.vocabulary.size}); speculative decoding needs one vocabulary, or set "
                "cross_vocabulary: true on the SSM to draft through text")
    logger.info("actors ready: target %s, proposers %s", info.name, list(group.names))
    return info
