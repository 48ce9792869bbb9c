"""A small gRPC client for the SpecInfer service (used by `specinfer client`, `demo` and tests)."""

from __future__ import annotations

import os
import time
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import specinfer_pb2 as pb
from protos import specinfer_pb2_grpc

from settings.config import APP_NAME, DEFAULT_AUTH_TOKEN_ENV
from .serve_requests import CHILDREN, MODES

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_CANCELLED: "cancelled", pb.FINISH_REASON_UNSPECIFIED: None}


def build_request(prompt: str | None = None, messages: Sequence[tuple[str, str]] = (), *,
                  max_new_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                  top_k: int | None = None, seed: int | None = None, stop: Sequence[str] = (),
                  mode: str | None = None, expansion: Sequence[int] | None = (), ssms: Sequence[str] | None = (),
                  children: str | None = None, sequence_depth: int | None = None,
                  adaptive: bool | None = None, prefetch: int | None = None) -> pb.GenerateRequest:
    """A GenerateRequest; None leaves a field unset (the server's default applies)."""
    request = pb.GenerateRequest(prompt=prompt or "", stop=list(stop),
                                 messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])
    for field, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_p", top_p),
                         ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(request, field, value)
    if mode or expansion or ssms or children or sequence_depth is not None or adaptive is not None \
            or prefetch is not None:
        s = request.speculation
        s.mode = {v: k for k, v in MODES.items()}[mode] if mode else pb.SPECULATION_MODE_UNSPECIFIED
        s.children = {v: k for k, v in CHILDREN.items()}[children] if children else pb.CHILDREN_RULE_UNSPECIFIED
        s.expansion.extend(expansion or ())
        s.ssms.extend(ssms or ())
        if sequence_depth is not None:
            s.sequence_depth = sequence_depth
        if adaptive is not None:
            s.adaptive = adaptive
        if prefetch is not None:
            s.prefetch = prefetch
    return request


def stats_dict(stats: pb.GenerationStats) -> dict:
    """The stats as plain JSON values (numbers stay numbers)."""
    fields = ("mode", "target_steps", "new_tokens", "tokens_per_step", "ms_per_token", "draft_ms", "verify_ms",
              "total_ms", "draft_tokens", "accepted_tokens")
    return {**{name: getattr(stats, name) for name in fields},
            "accepted_per_ssm": dict(stats.accepted_per_ssm), "accepted_per_depth": list(stats.accepted_per_depth),
            "hop_ms": dict(stats.hop_ms), "tree_sizes": list(stats.tree_sizes), "prefetch_hits": stats.prefetch_hits,
            "prefetch_misses": stats.prefetch_misses, "prefetch_saved_ms": stats.prefetch_saved_ms,
            "drafted_through_text": dict(stats.drafted_through_text),
            "survived_through_text": dict(stats.survived_through_text)}


def response_dict(response: pb.GenerateResponse) -> dict:
    return {"text": response.text, "token_ids": list(response.token_ids),
            "finish_reason": FINISH_NAMES.get(response.finish_reason), "stats": stats_dict(response.stats)}


REPLICA_METADATA = "specinfer-replica"  # gRPC trailing metadata: the answering replica, "<app>/<replica id>"


def answered_by(call) -> str | None:
    """The replica that answered a finished call (a stream read to its end, or the call object of
    ``stub.Generate.with_call``): ``<application>/<replica id>``, from its trailing metadata."""
    return dict(call.trailing_metadata() or ()).get(REPLICA_METADATA)


class Client:
    """Blocking client over one channel. ``timeout`` is the per-call deadline in seconds.

    ``token``: the bearer token of a server with auth on; None reads ``$SPECINFER_AUTH_TOKEN`` (the
    variable the server reads by default); empty sends none.
    """

    def __init__(self, address: str, application: str = APP_NAME, token: str | None = None):
        self.address = address
        self.metadata = (("application", application),)  # picks the Serve application
        token = os.environ.get(DEFAULT_AUTH_TOKEN_ENV) if token is None else token
        if token:
            self.metadata += (("authorization", f"Bearer {token}"),)
        self.channel = grpc.insecure_channel(address)
        self.stub = specinfer_pb2_grpc.SpecInferStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> pb.GenerateResponse:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def stream(self, request: pb.GenerateRequest, timeout: float | None = None):
        """The streaming call: iterate it for GenerateChunks; ``.cancel()`` stops the generation."""
        return self.stub.GenerateStream(request, timeout=timeout, metadata=self.metadata)

    def generate_streamed(self, request: pb.GenerateRequest, timeout: float | None = None) -> pb.GenerateResponse:
        """Stream, then fold the chunks into one GenerateResponse."""
        response = pb.GenerateResponse()
        for chunk in self.stream(request, timeout):
            response.text += chunk.text
            response.token_ids.extend(chunk.token_ids)
            if chunk.finish_reason:
                response.finish_reason = chunk.finish_reason
                response.stats.CopyFrom(chunk.stats)
        return response

    def health_status(self, timeout: float = 10.0) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... or the call's error code and details."""
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def serving(self, timeout: float = 10.0) -> bool:
        return self.health_status(timeout) == "SERVING"

    def wait_ready(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Poll grpc.health.v1 Check until SERVING; raise TimeoutError with the last answer."""
        deadline, last = time.monotonic() + timeout_s, "no answer"
        while time.monotonic() < deadline:
            last = self.health_status(min(10.0, max(0.1, deadline - time.monotonic())))
            if last == "SERVING":
                return
            time.sleep(poll_s)
        raise TimeoutError(f"{self.address} not ready after {timeout_s:.0f} s ({last})")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
