"""Stream cancels that reach the replica: a wrapper for Ray Serve 2.60's proxy streaming handler.

``cluster.wire.add_SpecInferServicer_to_server`` (named in ``grpc_options.grpc_servicer_functions``)
registers our service through ``cancels_reach_replica(server)``: inside Serve's proxy actor the
server is a ``gRPCGenericServer``, whose ``service_handler_factory`` makes every method's handler.

Why: in Serve 2.60 a client cancel (or closed channel) that arrives while the proxy hands a chunk
to gRPC is lost. gRPC cancels its task outside the handler's generator, which is finalized later
(``aclose``); the ``GeneratorExit`` raised at ``yield result`` in
``gRPCProxy.send_request_to_replica`` is caught by its ``except BaseException``, so the replica call
is never cancelled and the request runs to its end. A cancel that arrives while the proxy awaits the
replica is handled: ``ProxyResponseGenerator.__anext__`` cancels the replica call on
``CancelledError``. So when our wrapper is closed before the stream ended, it resumes Serve's
generator in a task and cancels that task while it awaits the replica: the handled path.

Serve's generator then finishes its bookkeeping (status, access log with the client's address) on
a call gRPC has already ended, and grpcio crashes the proxy (SIGSEGV) when asked for ``peer()`` of a
finished call. The handler therefore sees the call through ``CallContext``: what it reads is taken
at the start, and once the call is over nothing reaches the real context.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Any, AsyncIterator, Callable, Iterator


@contextmanager
def cancels_reach_replica(server: Any) -> Iterator[None]:
    """While handlers are registered on Serve's proxy server, its server-streaming handlers are
    made by ``cancel_safe``; any other server (a plain ``grpc.aio`` one) is left as it is."""
    from ray.serve._private.grpc_util import gRPCGenericServer

    if not isinstance(server, gRPCGenericServer):
        yield
        return
    factory = server.service_handler_factory
    server.service_handler_factory = cancel_safe(factory)
    try:
        yield
    finally:
        server.service_handler_factory = factory


def cancel_safe(factory: Callable) -> Callable:
    """Wrap Serve's handler factory: a unary-stream handler cancels the replica call when gRPC
    closes it early, and Serve's handler sees the call through a ``CallContext``."""
    from ray.serve._private.proxy_request_response import gRPCStreamingType

    def make(service_method: str, streaming_type) -> Callable:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        if streaming_type != gRPCStreamingType.UNARY_STREAM:
            return handler
        return cancel_safe_stream(handler)

    return make


def cancel_safe_stream(handler: Callable) -> Callable:
    """``handler(request, context)``: an async generator of response bytes (Serve's ``unary_stream``)."""

    async def unary_stream(request_proto: Any, context: Any) -> AsyncIterator[bytes]:
        call = CallContext(context)
        messages = handler(request_proto, call)
        finished = False
        try:
            async for message in messages:
                yield message
            finished = True
        finally:
            if not finished:  # closed or cancelled at our yield: the client is gone
                call.end()
                await cancel_upstream(messages)

    return unary_stream


async def cancel_upstream(messages: Any) -> None:
    """Stop the replica call behind Serve's stream generator, which is suspended at a yield.

    Resume it in a task and cancel the task once it awaits the replica's next chunk (where Serve
    cancels the call); chunks that were already there are dropped. Ends when the generator ends.
    """
    while True:
        pending = asyncio.ensure_future(messages.__anext__())
        await asyncio.sleep(0)  # the task runs down to its await on the replica first
        pending.cancel()
        try:
            await pending
        except (asyncio.CancelledError, StopAsyncIteration):
            break
    await messages.aclose()


class CallContext:
    """A gRPC servicer context as Serve's handler sees it: calls pass through while the call is on;
    after ``end()`` the peer and metadata read at the start are answered from a copy, and every
    other call is dropped (returns None)."""

    def __init__(self, context: Any):
        self._context, self._on = context, True
        self._peer = context.peer()
        self._metadata = tuple(context.invocation_metadata())

    def end(self) -> None:
        self._on = False

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._context, name)
        if self._on or not callable(attribute):
            return attribute
        return _dropped


def _dropped(*args: Any, **kwargs: Any) -> None:
    return None
