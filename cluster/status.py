"""How a request's failure is answered: the gRPC status for each exception, once.

``grpc_status`` sets the code on the Serve gRPC context; ``status_name`` gives the same name for
the metrics and the OpenAI routes (which map it to an HTTP status). Example::

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

from actors.common import StateLost
from engine.kv_pool import PoolExhausted

from .serve_requests import InvalidArgument

logger = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """More requests in flight than server.max_concurrent_requests."""


class Draining(RuntimeError):
    """The replica is shutting down: running requests finish, new ones are refused (UNAVAILABLE)."""


BUSY = (Overloaded, PoolExhausted)  # RESOURCE_EXHAUSTED: too many requests, or no KV memory for one


@contextmanager
def grpc_status(context: RayServegRPCContext | None):
    """Map exceptions to gRPC status codes on the Serve gRPC context, then re-raise.

    Serve forwards a code set before raising (as ``gRPCStatusError``) to the client with its
    details; it also logs the traceback, so the unary method answers the client's own mistakes
    (bad argument, overload) by returning with the code set instead. Cancellation (client gone,
    deadline passed) is a BaseException and passes through.
    """
    try:
        yield
    except InvalidArgument as error:
        _set_status(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        raise
    except BUSY as error:
        _set_status(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(getattr(error, "cause", None) or error))
        raise
    except Draining as error:
        _set_status(context, grpc.StatusCode.UNAVAILABLE, str(error))
        raise
    except (RayActorError, StateLost) as error:
        _set_status(context, grpc.StatusCode.UNAVAILABLE, f"a model actor failed: {error}")
        raise
    except Exception as error:
        logger.exception("request failed")
        _set_status(context, grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
        raise


def _set_status(context: RayServegRPCContext | None, code: grpc.StatusCode, details: str) -> None:
    if context is not None:
        context.set_code(code)
        context.set_details(details)


def status_name(error: BaseException) -> str:
    """The gRPC status name a request that ended with ``error`` gets (as ``grpc_status`` sets it).

    A passed deadline reaches the replica as a cancellation, like a client cancel: CANCELLED.
    """
    if isinstance(error, InvalidArgument):
        return "INVALID_ARGUMENT"
    if isinstance(error, BUSY):
        return "RESOURCE_EXHAUSTED"
    if isinstance(error, (RayActorError, StateLost, Draining)):
        return "UNAVAILABLE"
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "INTERNAL"
