"""How a request's failure is answered: the gRPC status for each exception, once.

``status_name`` is the one table; ``grpc_status`` sets its code (with ``status_details``) on the
Serve gRPC context, the metrics count it and the OpenAI routes map it to an HTTP status. Example::

    status_name(Overloaded("busy"))        # -> "RESOURCE_EXHAUSTED"
    status_name(asyncio.CancelledError())  # -> "CANCELLED"
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager

import grpc
from ray.exceptions import RayActorError
from ray.serve.grpc_util import RayServegRPCContext

from engine.kv_pool import PoolExhausted, StateLost

from .auth import Unauthenticated
from .serve_requests import InvalidArgument

logger = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """More requests in flight than server.max_concurrent_requests."""


class Draining(RuntimeError):
    """The replica is shutting down: running requests finish, new ones are refused (UNAVAILABLE)."""


BUSY = (Overloaded, PoolExhausted)  # RESOURCE_EXHAUSTED: too many requests, or no KV memory for one
# Refusals the unary method answers by returning with the status set (not a server fault to log).
ANSWERED = (InvalidArgument, Unauthenticated, Draining, *BUSY)


def status_name(error: BaseException) -> str:
    """The gRPC status name a request that ended with ``error`` gets: the one table, used by
    ``grpc_status``, the metrics and the OpenAI routes.

    A passed deadline reaches the replica as a cancellation, like a client cancel: CANCELLED.
    """
    if isinstance(error, InvalidArgument):
        return "INVALID_ARGUMENT"
    if isinstance(error, Unauthenticated):
        return "UNAUTHENTICATED"
    if isinstance(error, BUSY):
        return "RESOURCE_EXHAUSTED"
    if isinstance(error, (RayActorError, StateLost, Draining)):
        return "UNAVAILABLE"
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "INTERNAL"


def status_details(error: BaseException) -> str:
    """What the client is told with that status. Example: a dead actor -> "a model actor failed: ..."."""
    if isinstance(error, (RayActorError, StateLost)):
        return f"a model actor failed: {error}"
    if isinstance(error, ANSWERED):
        return str(getattr(error, "cause", None) or error)
    return f"{type(error).__name__}: {error}"


@contextmanager
def grpc_status(context: RayServegRPCContext | None):
    """Set the status of any exception on the Serve gRPC context, then re-raise.

    Serve forwards a code set before raising (as ``gRPCStatusError``) to the client with its
    details; it also logs the traceback, so the unary method answers the ``ANSWERED`` refusals by
    returning with the code set instead. Cancellation (client gone, deadline passed) is a
    BaseException and passes through.
    """
    try:
        yield
    except Exception as error:
        name = status_name(error)
        if name == "INTERNAL":
            logger.exception("request failed")
        if context is not None:
            context.set_code(grpc.StatusCode[name])
            context.set_details(status_details(error))
        raise
