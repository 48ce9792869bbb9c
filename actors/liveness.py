"""Which of a replica's actors are alive: failures seen by calls, cheap ``ping`` probes, health.

Ray restarts a killed actor (``max_restarts`` -1), but a call sent while it restarts waits for the
restart (a model load). So a role whose call failed with an actor error is marked down, its
callers go around it (``actors.backend``: a proposer is left out of the step, the merge falls back
to the root-only tree, the verifier fails fast), and it is probed with ``ping`` (at most every
``retry_interval_s``, ``probe_timeout_s`` each) until it answers: then it is used again.

Health (``report``) probes every actor at most once per ``cache_s`` and is bad while any actor
does not answer or is marked down; ``unhealthy_for_s`` says for how long without a break.
Probe timeouts alone never mark an actor down for requests: a busy verifier must not fail them.

Example: liveness.failed("ssm/a") -> liveness.usable("ssm/a") is False until a probe
(at most every retry_interval_s) finds it ready again; liveness.recoveries then lists how long
it was down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from ray.exceptions import RayActorError

from .detached import task_detached

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovery:
    """An actor that was marked down answered again ``down_s`` seconds after the failure was seen."""

    role: str
    down_s: float


@dataclass(frozen=True)
class HealthReport:
    serving: bool
    down: tuple[str, ...]  # roles that did not answer their probe or are marked down
    unhealthy_for_s: float  # how long health has been bad without a break (0 when serving)
    draining: bool = False  # the replica refuses new requests (set by the ingress, not by probes)


class Liveness:
    """Down marks and probes for the actors ``handles`` (role -> actor handle) of one replica."""

    def __init__(self, handles: dict[str, object], probe_timeout_s: float = 2.0, retry_interval_s: float = 2.0,
                 cache_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.handles, self.clock = dict(handles), clock
        self.probe_timeout_s, self.retry_interval_s, self.cache_s = probe_timeout_s, retry_interval_s, cache_s
        self._down: dict[str, float] = {}  # role -> when its failure was seen
        self._next_probe: dict[str, float] = {}
        self._probes: set[asyncio.Future] = set()  # background probes (kept referenced until done)
        # ActorHandle has no public id; errors name the actor by this hex id (RayActorError.actor_id)
        self._ids = {handle._actor_id.hex(): role for role, handle in self.handles.items()}
        self._report: tuple[float, HealthReport] | None = None
        self._reporting: asyncio.Future | None = None
        self._unhealthy_since: float | None = None
        self.recoveries: list[Recovery] = []

    def role_of(self, error: RayActorError) -> str | None:
        """The role of the actor an actor error names (it may arrive through a later task)."""
        return self._ids.get(error.actor_id or "")

    def failed(self, role: str) -> None:
        """A call to ``role`` failed with an actor error: go around it until a probe answers."""
        if role not in self._down:
            logger.warning("actor %s failed; going around it until it answers again", role)
            self._down[role] = self.clock()
            self._next_probe[role] = self.clock()

    def usable(self, role: str) -> bool:
        """False while ``role`` is marked down; then starts a probe in the background when one is
        due, so no caller waits for a restarting actor."""
        if role not in self._down:
            return True
        if self.clock() >= self._next_probe[role]:
            self._next_probe[role] = self.clock() + self.retry_interval_s
            # detached: sent in the caller's context, the probe would be cancelled with the caller
            probe = task_detached(self._probe(role))
            self._probes.add(probe)
            probe.add_done_callback(self._probes.discard)
        return False

    async def report(self) -> HealthReport:
        """Every actor probed (cached for ``cache_s``; concurrent callers share one round)."""
        cached = self._report
        if cached is not None and self.clock() - cached[0] < self.cache_s:
            return cached[1]
        if self._reporting is None:
            self._reporting = task_detached(self._probe_all())
        reporting = self._reporting
        try:
            return await asyncio.shield(reporting)
        finally:
            if self._reporting is reporting and reporting.done():
                self._reporting = None

    async def _probe_all(self) -> HealthReport:
        roles = list(self.handles)
        answered = await asyncio.gather(*(self._probe(role) for role in roles))
        down = tuple(role for role, ok in zip(roles, answered) if not ok or role in self._down)
        now = self.clock()
        if down and self._unhealthy_since is None:
            self._unhealthy_since = now
        elif not down:
            self._unhealthy_since = None
        since = self._unhealthy_since
        report = HealthReport(not down, down, 0.0 if since is None else now - since)
        self._report = (now, report)
        return report

    async def _probe(self, role: str) -> bool:
        """``ping`` within the timeout; an answer clears a down mark (and records the recovery)."""
        try:
            await asyncio.wait_for(asyncio.ensure_future(self.handles[role].ping.remote()), self.probe_timeout_s)
        except (asyncio.TimeoutError, RayActorError):
            return False
        since = self._down.pop(role, None)
        if since is not None:
            self.recoveries.append(Recovery(role, self.clock() - since))
            logger.info("actor %s answers again after %.1f s", role, self.clock() - since)
        return True
