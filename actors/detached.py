"""Send actor calls outside the caller's Ray task, so that cancelling the caller spares them.

Ray makes a call the child of the task whose asyncio context sends it (its task id lives in a
context variable), and cancels the children with the task: Serve's proxy cancels a request's task,
recursively, when the client goes away. Cleanup (``release``) and shared probes (``ready``) must
survive that, so they are sent from an empty context, which belongs to no request.

Example, inside an async actor method running as task T:
    handle.release.remote("r1")                      # a child of T: cancelled with T
    call_detached(handle.release.remote, "r1")       # nobody's child
    task_detached(probe())                           # an asyncio task whose calls are nobody's children
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Callable, Coroutine, TypeVar

T = TypeVar("T")


def call_detached(function: Callable[..., T], *args: Any) -> T:
    """Run ``function(*args)`` now, in an empty context (no caller's task to be a child of)."""
    return contextvars.Context().run(function, *args)


def task_detached(coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Start ``coroutine`` as a task of the running loop in an empty context (``ensure_future``
    would copy the caller's)."""
    return asyncio.get_running_loop().create_task(coroutine, context=contextvars.Context())
