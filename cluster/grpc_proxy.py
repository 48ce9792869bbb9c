"""The SpecInfer gRPC service as Serve's proxy registers it, with stream cancels that reach the replica.

``grpc_options.grpc_servicer_functions`` names ``cluster.grpc_proxy:add_SpecInferServicer_to_server``
(configs/serve.yaml): Serve calls it inside its proxy actor with its ``gRPCGenericServer``, whose
``service_handler_factory`` makes the handler of every method.

Why: in Ray Serve 2.60 a client cancel that arrives while the proxy hands a chunk to gRPC is lost.
gRPC cancels the handler task outside the response generator; the generator is finalized later
(``aclose``), and the ``GeneratorExit`` raised at ``yield result`` in
``gRPCProxy.send_request_to_replica`` is caught by its ``except BaseException``: the replica call
is never cancelled and the request runs to its end. A cancel that arrives while the proxy awaits
the replica is handled: ``ProxyResponseGenerator.__anext__`` cancels the replica call on
``CancelledError``. So when our wrapper is closed before the stream ended, it resumes Serve's
generator in a task and cancels that task while it awaits the replica, which takes the handled path.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from protos import specinfer_pb2_grpc


def add_SpecInferServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 (gRPC's name)
    """Register the SpecInfer service; its server-streaming handlers pass cancels to the replica."""
    factory: Callable = server.service_handler_factory  # a Serve gRPCGenericServer
    server.service_handler_factory = cancel_safe(factory)
    try:
        specinfer_pb2_grpc.add_SpecInferServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory


def cancel_safe(factory: Callable) -> Callable:
    """Wrap Serve's handler factory: unary-stream handlers cancel the replica call when closed early."""
    from ray.serve._private.proxy_request_response import gRPCStreamingType

    def make(service_method: str, streaming_type) -> Callable:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        if streaming_type != gRPCStreamingType.UNARY_STREAM:
            return handler

        async def unary_stream(request_proto, context) -> AsyncIterator[bytes]:
            messages = handler(request_proto, context)
            finished = False
            try:
                async for message in messages:
                    yield message
                finished = True
            finally:
                if not finished:  # closed or cancelled at our yield: the client is gone
                    await cancel_upstream(messages)

        return unary_stream

    return make


async def cancel_upstream(messages) -> None:
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
