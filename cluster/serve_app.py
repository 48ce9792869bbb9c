"""The Ray Serve application ``specinfer``: a gRPC ingress over plain actors.

The Serve gRPC proxy routes ``/specinfer.v1.SpecInfer/Generate`` and ``.../GenerateStream`` to
the methods of the same name below (and the standard ``grpc.health.v1.Health/Check``). Each
ingress replica owns its own verifier, SSM and merge actors (``actors.group``) and drives every
request's step loop itself (``engine.step.Session`` over ``actors.backend.ActorBackend``).
See docs/serving.md for the reasoning.

The same deployment is also the application's HTTP ingress: Serve's HTTP proxy hands it the
OpenAI-compatible routes of ``cluster.openai_api`` (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``), which run through the same ``generate_updates`` as the gRPC methods. Every request is
counted in the Prometheus metrics of ``cluster.metrics``.

    serve run configs/serve.yaml            # import_path: cluster.serve_app:app_builder
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import aclosing, contextmanager
from dataclasses import replace
from typing import AsyncIterator

import torch
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from actors.common import process_memory
from actors.executor import ActorExecutor
from actors.group import start
from actors.backend import ActorBackend, Admission
from actors.liveness import HealthReport, Liveness
from engine.budget import RunningLoad, budget_from_curve
from engine.loop import EngineLoop, LoopLimits, QueueFull
from engine.requests import StepUpdate
from engine.step import Session, plan_proposers, tree_reservation
from engine.kv_pool import PoolExhausted
from protos import specinfer_pb2 as pb

from . import request_log
from .auth import auth_sources, auth_token, check_metadata
from .build import speculation_options, tree_cost
from settings.config import EngineConfig
from .metrics import RequestObservation, ServingMetrics, observed
from .serve_client import REPLICA_METADATA
from .serve_requests import (InvalidArgument, ModelLimits, finish_reason, parse_request, sampling_params,
                             stats_message)
from .status import ANSWERED, Draining, Overloaded, grpc_status, status_name
from .wire import decode_request

logger = logging.getLogger(__name__)


def _serve_request_id() -> str | None:
    """Serve's id of the request (``x-request-id`` / gRPC ``request_id`` metadata, or generated)."""
    try:
        return serve.context._get_serve_request_context().request_id
    except Exception:  # outside a Serve request (tests calling the method directly)
        return None


@serve.deployment(name="SpecInferIngress", ray_actor_options={"num_cpus": 0.1})
@serve.ingress()  # HTTP: the ASGI app comes from __serve_build_asgi_app__ once the replica is up
class SpecInferIngress:
    """Admission control, request checks, and one async step loop per request."""

    async def __init__(self, config: EngineConfig):
        torch.set_num_threads(1)  # the ingress only tokenizes and counts
        request_log.install()
        self.config, self.base_options = config, speculation_options(config)
        self.auth_token = auth_token(config.server)
        logger.info("authentication %s", f"on (bearer tokens from {auth_sources(config.server)})"
                    if self.auth_token else "off")
        # Actors named after the application and the replica's unique id: replicas never collide,
        # and each replica's actors (and their reserved resources) die with it, e.g. on scale-down.
        replica = serve.get_replica_context()
        self.replica = f"{replica.app_name}/{replica.replica_tag}"
        self.group, info = await start(config, self.replica)
        self.info = info
        self.tokenizer, self.eos_ids = info.tokenizer, info.eos_ids
        budget, curve = config.server.tree_budget, await self.group.verifier.measure_verify_cost.remote()
        by_budget = curve and config.tree_budget_applies
        self.budget = budget_from_curve(curve, budget.slack, budget.min_tree_nodes,
                                        budget.disable_above_running) if by_budget else None
        self.cost = tree_cost(config, curve)
        # cost-aware trees choose their size for the batch's goodput against the running requests' load
        self.load = RunningLoad() if self.budget is not None else None
        if self.budget is not None:
            logger.info("tree budget: %d tree tokens per pass (verify-cost curve %s)", self.budget.cap, curve)
        self.limits = ModelLimits(self.group.names, self.group.neural, info.max_context,
                                  prefetch=any(self.group.neural))
        health = config.server.health
        self.liveness = Liveness(self.group.roles(), health.probe_timeout_s, health.retry_interval_s)
        self.active, self.draining = 0, False
        self.metrics = ServingMetrics(model_name=config.target.name)  # vLLM's model_name label
        self.metrics.running(0)
        self.loop = self._engine_loop() if config.server.engine_loop else None

    def __serve_build_asgi_app__(self):
        """The OpenAI-compatible HTTP routes, served by this replica (called once, after __init__)."""
        from .openai_api import build_app

        return build_app(self)

    async def Generate(self, request: pb.GenerateRequest | bytes,
                       grpc_context: RayServegRPCContext | None = None) -> pb.GenerateResponse:
        text, token_ids, last = [], [], None
        try:
            async with aclosing(self.generate_updates(request, grpc_context)) as updates:
                async for update in updates:
                    text.append(update.text)
                    token_ids.extend(update.token_ids)
                    last = update
        except ANSWERED:
            if grpc_context is None:
                raise
            return pb.GenerateResponse()  # the status set on grpc_context is the answer
        return pb.GenerateResponse(text="".join(text), token_ids=token_ids,
                                   finish_reason=finish_reason(last.finish_reason), stats=stats_message(last.stats))

    async def GenerateStream(self, request: pb.GenerateRequest | bytes,
                             grpc_context: RayServegRPCContext | None = None) -> AsyncIterator[pb.GenerateChunk]:
        async with aclosing(self.generate_updates(request, grpc_context)) as updates:  # closed even if abandoned
            async for update in updates:
                chunk = pb.GenerateChunk(text=update.text, token_ids=update.token_ids)
                if update.finish_reason is not None:
                    chunk.finish_reason = finish_reason(update.finish_reason)
                    chunk.stats.CopyFrom(stats_message(update.stats))
                yield chunk

    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        """grpc.health.v1: SERVING while every actor answers, NOT_SERVING while one is dead or
        restarting (``actors.liveness``: probes cached for a second) or the replica drains.
        ``service`` is not looked at."""
        return health_pb2.HealthCheckResponse(status=_serving_status((await self.health()).serving))

    async def Watch(self, request: health_pb2.HealthCheckRequest) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """The current status, once (the stream ends: a watch would hold a replica slot for good)."""
        yield health_pb2.HealthCheckResponse(status=_serving_status((await self.health()).serving))

    async def health(self) -> HealthReport:
        """Whether every actor answers and the replica admits requests (not while it drains); also
        behind HTTP ``GET /health``."""
        report = await self.liveness.report()
        return replace(report, serving=report.serving and not self.draining, draining=self.draining)

    async def check_health(self) -> None:
        """Serve's replica check: fails only when actors stay down past server.health.unhealthy_after_s
        (a failing check replaces the replica and every actor it owns; a drain never fails it)."""
        report, bound = await self.liveness.report(), self.config.server.health.unhealthy_after_s
        if report.unhealthy_for_s > bound:
            raise RuntimeError(f"actors {list(report.down)} down for {report.unhealthy_for_s:.0f} s "
                               f"(server.health.unhealthy_after_s {bound:g})")

    def _engine_loop(self) -> EngineLoop:
        """The replica's engine loop over its actors, and the task that steps it while it has work."""
        server = self.config.server
        chunk = server.batching.prefill_chunk_tokens if server.batching.enabled else None
        limits = LoopLimits(server.max_concurrent_requests, server.max_waiting_requests, chunk)
        executor = ActorExecutor(self.group, self.liveness, self.info.kv_capacity_tokens, server.batching.block_size)
        loop = EngineLoop(executor, self.tokenizer, self.eos_ids, limits, self.cost,
                          self.budget.per_request if self.budget else None, server.tree_budget.draft_gate)
        loop.observers.append(self._observe_iteration)  # gauges and token counters every iteration
        self._woken, self._streams = asyncio.Event(), {}
        self._loop_task = asyncio.get_running_loop().create_task(self._run_loop(loop))
        return loop

    def _observe_iteration(self, stats) -> None:
        self.metrics.iteration(stats)
        self.metrics.running(self.active - stats.waiting)  # vLLM's meaning: in flight, not queued

    async def _run_loop(self, loop: EngineLoop) -> None:
        """Step the loop while it has work; wake every stream after each iteration."""
        while True:
            if not loop.has_work:
                self._woken.clear()
                await self._woken.wait()
                continue
            try:
                await loop.step_async()
            except Exception as error:  # a bug, not a request's fault: end them all, keep serving
                logger.exception("engine loop iteration failed")
                loop.abort(error)
            for event in list(self._streams.values()):
                event.set()
            await asyncio.sleep(0)

    async def _loop_updates(self, parsed) -> AsyncIterator[StepUpdate]:
        """A request's updates through the replica's engine loop (queued while the batch is full)."""
        try:
            request_id = self.loop.submit(parsed)
        except QueueFull as error:
            raise Overloaded(str(error)) from None
        self._streams[request_id] = event = asyncio.Event()
        self._woken.set()
        try:
            while True:
                await event.wait()
                event.clear()
                for update in self.loop.take(request_id):
                    yield update
                    if update.finish_reason is not None:
                        return
        finally:
            self._streams.pop(request_id, None)
            self.loop.cancel(request_id)

    async def generate_updates(self, request: pb.GenerateRequest, context,
                               observation: RequestObservation | None = None) -> AsyncIterator[StepUpdate]:
        """Admit, check, run; the request's state is released in every actor however it ends.

        ``observation`` (default: a gRPC one) collects what the metrics record when it ends; the
        OpenAI routes pass their own and read its prompt_tokens.
        """
        observation = observation if observation is not None else RequestObservation("grpc")
        request_id = uuid.uuid4().hex  # the actors' key for the request's state, and its log tag
        if context is not None:  # which replica answered (the scale-out bench counts them)
            context.set_trailing_metadata([(REPLICA_METADATA, self.replica)])
        with request_log.request_logging(request_id), observed(self.metrics, observation, status_name), \
                grpc_status(context), self._admitted(context):
            parsed = parse_request(decode_request(request), self.config, self.base_options, self.tokenizer,
                                   self.limits)
            observation.admitted(len(parsed.prompt_ids))
            if self.loop is not None and not parsed.speculation.prefetch:  # prefetch: its own step loop
                observation.per_iteration = True
                async for update in self._loop_updates(parsed):
                    observation.update(update)
                    yield update
                return
            backend = ActorBackend(self.group, request_id, parsed.sampling, self.liveness, self._admission(parsed),
                                   prefetch=parsed.speculation.prefetch)
            session = Session(backend, parsed, self.group.names, self.group.neural, self.tokenizer, self.eos_ids,
                              self._tree_budget, self.cost, self.load)
            logger.info("request: %d prompt tokens, max_new_tokens %d, mode %s, %s (serve request id %s)",
                        len(parsed.prompt_ids), parsed.max_new_tokens, parsed.speculation.mode, observation.api,
                        _serve_request_id())
            try:
                async for update in session.updates():
                    observation.update(update)
                    yield update
            finally:
                session.close()

    def _admission(self, request) -> Admission:
        """The request's worst-case KV need in the verifier's pool: prompt, output and one merged
        tree (``engine.step.tree_reservation``)."""
        capacity = self.info.kv_capacity_tokens
        if capacity is None:
            return Admission()
        # with the step's cost model: cost-aware trees may use max_tree_nodes, more than a schedule's tree
        tree = tree_reservation(plan_proposers(self.group.names, self.group.neural, request.speculation,
                                               request.sampling, self.cost))
        need = len(request.prompt_ids) + request.max_new_tokens + tree
        if need > capacity:
            raise PoolExhausted(f"the request needs {need} tokens of KV cache (prompt + max_new_tokens + tree) but "
                                f"the pool holds {capacity} (server.batching.kv_cache_tokens)")
        return Admission(need, self.config.server.batching.admission_timeout_s)

    def _tree_budget(self) -> int | None:
        """Nodes per request's tree this step: the verify-cost cap shared by the running requests."""
        return None if self.budget is None else self.budget.per_request(self.active)

    @contextmanager
    def _admitted(self, grpc_context: RayServegRPCContext | None):
        """Admission: the bearer token (gRPC calls; the HTTP routes check their header, and calls
        through a deployment handle come from inside the cluster), then draining, then the limit."""
        if grpc_context is not None:
            check_metadata(grpc_context.invocation_metadata(), self.auth_token)
        server = self.config.server
        limit = server.max_concurrent_requests + (server.max_waiting_requests if server.engine_loop else 0)
        if self.draining:
            raise Draining("server draining: it is shutting down and admits no new requests; retry on another "
                           "replica or later")
        if self.active >= limit:
            bound = ("server.max_concurrent_requests + server.max_waiting_requests" if server.engine_loop
                     else "server.max_concurrent_requests")
            raise Overloaded(f"server busy: {self.active} requests in flight, {bound} is {limit}; retry later")
        self.active += 1
        self.metrics.running(self._running())
        try:
            yield
        finally:
            self.active -= 1
            self.metrics.running(self._running())

    def _running(self) -> int:
        """Requests in flight and not in the engine loop's queue."""
        return self.active - (len(self.loop.waiting) if self.loop is not None else 0)

    async def drain(self, timeout_s: float | None = None) -> int:
        """Refuse new requests (UNAVAILABLE) and wait up to ``timeout_s`` (default
        server.drain_timeout_s) for the running ones to finish. Returns how many still run.

        `specinfer serve` calls it on SIGTERM before stopping Serve; Serve's own graceful shutdown
        (redeploys, scale-down) stops routing to the replica and waits for running requests too
        (``app_builder``).
        """
        self.draining = True
        deadline = asyncio.get_running_loop().time() + (
            self.config.server.drain_timeout_s if timeout_s is None else timeout_s)
        while self.active and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        logger.info("drained: %d requests still running", self.active)
        return self.active

    def num_active(self) -> int:
        """Requests in flight on this replica (for tests and metrics)."""
        return self.active

    def actors(self) -> dict:
        """This replica's actor handles by role (for tests): verifier, merge, ssm/<name>."""
        return self.group.roles()

    def memory(self) -> dict[str, float]:
        """This replica process's memory in MB (``actors.common.process_memory``)."""
        return process_memory()

    def recoveries(self) -> list:
        """Actors that were marked down and answered again, with how long it took (for bench/faults.py)."""
        return list(self.liveness.recoveries)

    def __del__(self):
        group = getattr(self, "group", None)
        if group is not None:
            try:
                group.kill()
            except Exception:  # Ray may already be shutting down
                pass


def _serving_status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


def app_builder(args: dict) -> serve.Application:
    """Serve application builder: ``args`` is the engine config (configs/default.yaml's fields).

    The deployment accepts more requests than server.max_concurrent_requests so that our own
    admission control, not Serve's queue, answers overload (RESOURCE_EXHAUSTED). A replica that
    Serve stops (redeploy, scale-down, shutdown) waits up to server.drain_timeout_s for its running
    requests (``graceful_shutdown_timeout_s``; Serve checks every ``graceful_shutdown_wait_loop_s``).
    """
    config = EngineConfig.model_validate(args or {})
    try:
        sampling_params(pb.GenerateRequest(), config)  # a request that sets nothing takes the defaults
    except InvalidArgument as error:
        raise ValueError(f"the config's defaults.{error}") from None
    limit, drain = config.server.max_concurrent_requests, config.server.drain_timeout_s
    return SpecInferIngress.options(max_ongoing_requests=4 * limit + 16, graceful_shutdown_timeout_s=drain,
                                    graceful_shutdown_wait_loop_s=1.0).bind(config)
