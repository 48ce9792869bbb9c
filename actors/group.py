"""Create, check and own the actors of one ingress replica."""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import ray

from settings.config import ActorOptions, EngineConfig

from .merge import MergeActor
from .ssm import SSMActor
from .verifier import TargetInfo, VerifierActor

logger = logging.getLogger(__name__)


class Releaser:
    """Sends ``release`` calls from its own thread, outside any request's Ray task.

    A call sent from the request's own coroutine is a child of the task Serve runs the request in,
    and when the client goes away Serve cancels that task with its children (``ray.cancel``,
    recursive). Whether a release sent from the coroutine's ``finally`` is among them is a race
    between the core worker's child cancellation and the coroutine's unwinding (it lost on a loaded
    CI box): the request's state and KV blocks would stay in the actors until the TTL sweep. From a
    thread of its own (no asyncio task context) the call is nobody's child.

    Example: ``Releaser().send([ssm, merge, verifier], "r1")`` returns at once; the calls
    ``release("r1")`` leave soon after, and the future it returned is done once they left.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def send(self, actors, request_id: str) -> Future:
        """Queue ``release(request_id)`` for each actor handle in ``actors``; the future is done
        once the calls were sent (not run)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="request-releases", daemon=True)
                self._thread.start()
        sent: Future = Future()
        self._queue.put((tuple(actors), request_id, sent))
        return sent

    def _run(self) -> None:
        while True:
            actors, request_id, sent = self._queue.get()
            for actor in actors:
                try:
                    actor.release.remote(request_id)
                except Exception:  # a handle that cannot send: its TTL sweep drops the state
                    logger.warning("release of request %s not sent", request_id, exc_info=True)
            sent.set_result(None)


@dataclass(frozen=True)
class ActorGroup:
    """Handles to one replica's actors. ``names``: proposers in engine order (SSMs, then suffix)."""

    names: tuple[str, ...]
    neural: tuple[bool, ...]
    ssms: tuple  # ActorHandle per config.ssms entry
    merge: object  # ActorHandle
    verifier: object  # ActorHandle
    releases: Releaser = field(default_factory=Releaser, compare=False, repr=False)

    def everyone(self) -> list:
        return [*self.ssms, self.merge, self.verifier]

    def roles(self) -> dict[str, object]:
        """Handles by role: ``verifier``, ``merge``, ``ssm/<name>`` (the names ``Liveness`` uses)."""
        handles = {"verifier": self.verifier, "merge": self.merge}
        handles.update({ssm_role(name): actor for name, actor in zip(self.names, self.ssms)})
        return handles

    def release(self, request_id: str) -> None:
        """Drop a request's state everywhere; fire and forget (safe inside a cancelled task: the
        calls leave from the ``Releaser``'s thread)."""
        self.releases.send(self.everyone(), request_id)

    def kill(self) -> None:
        try:
            ray.get(self.verifier.shutdown.remote(), timeout=15)
        except Exception:  # a dead or stuck verifier: its ranks die with it
            logger.warning("verifier did not shut down cleanly", exc_info=True)
        for actor in self.everyone():
            ray.kill(actor, no_restart=True)


def ssm_role(name: str) -> str:
    return f"ssm/{name}"


def _options(options: ActorOptions, name: str, namespace: str | None) -> dict:
    # Ray starts workers with OMP_NUM_THREADS=1, which the BLAS libraries read once at start-up:
    # give the actor's process the configured thread count from the start.
    threads = str(options.torch_threads)
    return {"name": name, "namespace": namespace, "num_cpus": options.num_cpus, "num_gpus": options.num_gpus,
            "max_restarts": options.max_restarts, "max_concurrency": options.max_concurrency,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}}}


def _verifier_options(config: EngineConfig) -> ActorOptions:
    """With tensor parallelism the verifier only coordinates: the ranks hold the GPUs and CPUs."""
    options = config.verifier.actor
    if config.verifier.tensor_parallel_size == 1:
        return options
    return options.model_copy(update={"num_cpus": 0.1, "num_gpus": 0.0, "torch_threads": 1})


def launch(config: EngineConfig, prefix: str, namespace: str | None = None) -> ActorGroup:
    """Start the verifier, one actor per SSM and the merge actor, named ``{prefix}/...``.

    Not detached: they belong to the caller (the ingress replica) and die with it.
    """
    server = config.server
    verifier = ray.remote(VerifierActor).options(
        **_options(_verifier_options(config), f"{prefix}/verifier", namespace)
    ).remote(config, config.verifier.actor.torch_threads, prefix, namespace)
    ssms = tuple(
        ray.remote(SSMActor).options(**_options(server.ssm_actor, f"{prefix}/ssm/{ssm.name}", namespace))
        .remote(config, index, server.ssm_actor.torch_threads)
        for index, ssm in enumerate(config.ssms))
    merge = ray.remote(MergeActor).options(**_options(server.merge_actor, f"{prefix}/merge", namespace)).remote(
        config.suffix, len(config.ssms), server.merge_actor.torch_threads, server.request_ttl_s)
    return ActorGroup(tuple(config.proposer_names()), tuple(config.proposer_neural()), ssms, merge, verifier)


async def check_ready(group: ActorGroup) -> TargetInfo:
    """Wait for every actor to load; check each SSM shares the target's vocabulary."""
    info: TargetInfo = await group.verifier.ready.remote()
    await group.merge.ready.remote()
    for name, vocabulary in [await actor.ready.remote() for actor in group.ssms]:
        if vocabulary != info.vocabulary:
            raise ValueError(
                f"SSM {name!r} (vocab {vocabulary.size}) does not share the vocabulary of target {info.name!r} "
                f"(vocab {info.vocabulary.size}); speculative decoding needs one vocabulary")
    logger.info("actors ready: target %s, proposers %s", info.name, list(group.names))
    return info
