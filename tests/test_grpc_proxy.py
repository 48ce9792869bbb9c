"""cluster.grpc_proxy: a stream closed at a yield cancels the replica call, and the handler's
bookkeeping after the call ended never reaches grpc's context.

``serve_like`` has the shape of Serve 2.60's ``gRPCProxy.send_request_to_replica`` under its
``unary_stream``: it awaits the replica's next chunk (cancelling the call when that await is
cancelled, as ``ProxyResponseGenerator`` does), yields it, catches ``BaseException`` and then does
its bookkeeping on the context (access log: ``peer()``; status: ``set_code``). The served figure
(cancels sent vs released) is in tests/test_load.py.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster.grpc_proxy import CallContext, cancel_safe_stream, cancels_reach_replica


class ReplicaCall:
    """The replica call behind a stream: ``ready`` chunks, then it waits for ever."""

    def __init__(self, ready: int):
        self.ready, self.cancelled = ready, False

    async def next_chunk(self) -> bytes:
        if self.ready:
            self.ready -= 1
            return b"chunk"
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class GrpcContext:
    """A servicer context that fails loudly when used after its call ended (grpcio crashes)."""

    def __init__(self):
        self.ended, self.codes = False, []

    def _check(self) -> None:
        if self.ended:
            raise AssertionError("the context of an ended call was used")

    def peer(self) -> str:
        self._check()
        return "ipv4:127.0.0.1:5000"

    def invocation_metadata(self) -> list:
        self._check()
        return [("application", "specinfer")]

    def set_code(self, code: str) -> None:
        self._check()
        self.codes.append(code)


def serve_like(call: ReplicaCall):
    async def unary_stream(request, context):
        status = "OK"
        try:
            while True:
                yield await call.next_chunk()
        except BaseException as error:  # noqa: B036 (Serve 2.60 does this)
            status = type(error).__name__
        context.peer()
        context.set_code(status)

    return unary_stream


async def read_then_close(stream, chunks: int, context: GrpcContext) -> None:
    """Read ``chunks`` chunks, then end the call as gRPC does when the client cancels at a write:
    the call is over, and the generator is closed from outside."""
    for _ in range(chunks):
        await stream.__anext__()
    context.ended = True
    await stream.aclose()


def test_without_the_wrapper_a_close_at_a_yield_loses_the_cancel():  # the negative control
    call, context = ReplicaCall(ready=2), GrpcContext()
    with pytest.raises(AssertionError, match="ended call"):  # and the bookkeeping hits the ended call
        asyncio.run(read_then_close(serve_like(call)(b"", context), 2, context))
    assert not call.cancelled


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_a_close_at_a_yield_cancels_the_replica_call(chunks):
    call, context = ReplicaCall(ready=5), GrpcContext()
    asyncio.run(read_then_close(cancel_safe_stream(serve_like(call))(b"", context), chunks, context))
    assert call.cancelled
    assert context.codes == []  # nothing reached the ended call


def test_a_cancel_while_awaiting_the_replica_is_passed_on():
    call, context = ReplicaCall(ready=1), GrpcContext()

    async def run() -> None:
        stream = cancel_safe_stream(serve_like(call))(b"", context)
        await stream.__anext__()
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises((asyncio.CancelledError, StopAsyncIteration)):
            await task

    asyncio.run(run())
    assert call.cancelled


def test_a_finished_stream_passes_through_and_sets_its_status():
    async def finite(request, context):
        for _ in range(3):
            yield b"chunk"
        context.set_code("OK")

    async def run(context) -> list[bytes]:
        return [m async for m in cancel_safe_stream(finite)(b"", context)]

    context = GrpcContext()
    assert asyncio.run(run(context)) == [b"chunk"] * 3
    assert context.codes == ["OK"]


def test_an_ended_call_context_answers_from_its_copy_and_drops_calls():
    context = GrpcContext()
    call = CallContext(context)
    call.set_code("A")
    call.end()
    context.ended = True
    assert call.peer() == "ipv4:127.0.0.1:5000"
    assert call.invocation_metadata() == (("application", "specinfer"),)
    assert call.set_code("B") is None
    assert context.codes == ["A"]


def test_only_serve_proxy_stream_handlers_are_wrapped():
    """Registered through cluster.wire on Serve's proxy server, GenerateStream gets the wrapper and
    Generate Serve's own handler; the factory is Serve's again afterwards; a plain server is
    left as it is."""
    from ray.serve._private.grpc_util import gRPCGenericServer

    from cluster.wire import add_SpecInferServicer_to_server

    made: list = []  # every handler Serve's factory made (generic and registered-method handlers)

    def factory(service_method, streaming_type):
        made.append(serve_like(ReplicaCall(0)))
        return made[-1]

    class Servicer:
        Generate = GenerateStream = staticmethod(lambda request, context: None)

    async def register() -> dict:
        server = gRPCGenericServer(factory)
        add_SpecInferServicer_to_server(Servicer(), server)
        assert server.service_handler_factory is factory
        ((generic,),) = server.generic_rpc_handlers
        return generic._method_handlers

    handlers = asyncio.run(register())
    stream = handlers["/specinfer.v1.SpecInfer/GenerateStream"]
    unary = handlers["/specinfer.v1.SpecInfer/Generate"]
    assert stream.unary_stream.__qualname__ == "cancel_safe_stream.<locals>.unary_stream"
    assert any(unary.unary_unary is handler for handler in made)

    class Plain:  # any other server
        pass

    plain = Plain()
    plain.service_handler_factory = factory
    with cancels_reach_replica(plain):
        assert plain.service_handler_factory is factory
