"""OpenAI-compatible HTTP routes on the ingress deployment (Ray Serve's HTTP proxy, port 8000).

    POST /v1/completions         prompt -> text (raw prompt, no chat template)
    POST /v1/chat/completions    messages -> assistant message (the target's chat template)
    GET  /v1/models, /v1/models/{model}, /health

Both POST routes accept ``stream: true`` (server-sent events: ``data: {...}`` chunks, then
``data: [DONE]``). A request becomes the same ``GenerateRequest`` the gRPC service takes and runs
through the same ingress method (``SpecInferIngress.generate_updates``): same checks, same actors, same
output. ``usage`` carries the token counts plus ``speculation`` (the request's GenerationStats).

Mapping: ``max_tokens`` / ``max_completion_tokens`` -> max_new_tokens, ``temperature``, ``top_p``,
``seed``, ``stop`` (string or list); extras ``top_k``, ``speculation`` {mode, expansion, ssms,
children, sequence_depth, adaptive, prefetch} and ``return_token_ids`` (vLLM's name: the choices carry
``token_ids``). Unset fields take the server's defaults (so an unset temperature is the server's, greedy by
default, not OpenAI's 1.0). Unsupported parameters set to anything but their neutral value (``n`` >
1, ``logprobs``, ``top_logprobs``, penalties, ``logit_bias``, ``best_of`` > 1, ``echo``, ``suffix``,
tools...) and bad values get HTTP 400 with an OpenAI error body
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``; an unknown model 404;
overload 429 (with Retry-After); a failed model actor 503; anything else 500. With authentication
on (``cluster.auth``) every ``/v1`` route needs ``Authorization: Bearer <token>``, else 401.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from protos import specinfer_pb2 as pb

from .auth import Unauthenticated, check_header
from .metrics import RequestObservation
from .serve_requests import CHILDREN, MODES, InvalidArgument, shorten
from .status import status_details, status_name

logger = logging.getLogger(__name__)

MODE_VALUES = {name: value for value, name in MODES.items()}
CHILDREN_VALUES = {name: value for value, name in CHILDREN.items()}
SPECULATION_KEYS = ("mode", "expansion", "ssms", "children", "sequence_depth", "adaptive", "prefetch")
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}  # "abort": vLLM's word
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
               "UNAVAILABLE": 503, "CANCELLED": 499, "INTERNAL": 500}
STATUS_OF_HTTP = {code: name for name, code in HTTP_STATUS.items()}
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 500: "server_error"}

# Parameters we cannot honour: each is accepted only at its neutral value (``None`` always is).
_NEUTRAL = {
    "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0), "logit_bias": ({},), "top_logprobs": (),
}
COMPLETION_UNSUPPORTED = {"logprobs": (), **_NEUTRAL}
CHAT_UNSUPPORTED = {
    "logprobs": (False,), **{k: v for k, v in _NEUTRAL.items() if k not in ("best_of", "echo", "suffix")},
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},), "audio": (), "modalities": (["text"],), "prediction": (),
    "web_search_options": (),
}
UNSUPPORTED_WHY = {
    "n": "only n=1 is supported", "best_of": "only best_of=1 is supported",
    "logprobs": "log probabilities are not returned", "top_logprobs": "log probabilities are not returned",
    "presence_penalty": "penalties are not supported", "frequency_penalty": "penalties are not supported",
    "logit_bias": "logit_bias is not supported", "echo": "echo is not supported", "suffix": "suffix is not supported",
    "tools": "tool calls are not supported", "tool_choice": "tool calls are not supported",
    "functions": "function calls are not supported", "function_call": "function calls are not supported",
    "response_format": "only plain text responses are supported", "audio": "audio output is not supported",
    "modalities": "only text output is supported", "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}


class OpenAIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {429: {"Retry-After": "1"}, 401: {"WWW-Authenticate": "Bearer"}}.get(self.status)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _printable(text: str) -> str:
    """``text`` with lone surrogates (from JSON ``"\\ud800"`` quoted in a message) escaped: the JSON
    response is UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, f"{param}: {shorten(message)}", param=param, code=code)


@dataclass(frozen=True)
class ParsedCall:
    """An OpenAI request turned into the gRPC request, plus how to answer it."""

    request: pb.GenerateRequest
    chat: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    max_tokens_param: str  # the OpenAI name max_new_tokens errors are reported under


# --- request conversion (no Ray, no HTTP) ---------------------------------------------------


def _present(body: dict, key: str) -> bool:
    return body.get(key) is not None


def _integer(body: dict, key: str, param: str | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(param or key, f"must be an integer, got {value!r}", "invalid_type")
    return value


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(key, f"must be a number, got {value!r}", "invalid_type")
    try:
        return float(value)
    except OverflowError:  # an integer beyond float range
        raise invalid(key, f"out of range: {value}") from None


def _boolean(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(key, f"must be a boolean, got {value!r}", "invalid_type")
    return value


def _text(value: str, param: str) -> str:
    """A string the gRPC request can carry: proto3 strings are UTF-8, so no lone surrogates
    (JSON's ``"\\ud800"`` decodes to one)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise invalid(param, f"is not valid Unicode: {error.reason} at position {error.start}") from None
    return value


def check_unsupported(body: dict, unsupported: dict[str, tuple]) -> None:
    for key, neutral in unsupported.items():
        value = body.get(key)
        if value is None or any(type(value) is type(n) and value == n for n in neutral):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value in neutral:
            continue  # 0 and 0.0, 1 and 1.0
        raise invalid(key, f"{UNSUPPORTED_WHY[key]} (got {value!r})", "unsupported_parameter")


def check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise invalid("model", f"must be a string, got {model!r}", "invalid_type")
    if model != model_name:
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{model_name}`.",
                          param="model", code="model_not_found")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [_text(stop, "stop")]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [_text(s, f"stop[{index}]") for index, s in enumerate(stop)]
    raise invalid("stop", f"must be a string or a list of strings, got {stop!r}", "invalid_type")


def _speculation(body: dict, request: pb.GenerateRequest) -> None:
    """The ``speculation`` extra: {mode, expansion, ssms, children, sequence_depth, adaptive, prefetch}."""
    spec = body.get("speculation")
    if spec is None:
        return
    if not isinstance(spec, dict):
        raise invalid("speculation", f"must be an object, got {spec!r}", "invalid_type")
    unknown = sorted(set(spec) - set(SPECULATION_KEYS))
    if unknown:
        raise invalid("speculation", f"unknown key(s) {unknown}; known: {list(SPECULATION_KEYS)}")
    s = request.speculation
    s.SetInParent()
    if spec.get("mode") is not None:
        if not isinstance(spec["mode"], str) or spec["mode"] not in MODE_VALUES:
            raise invalid("speculation.mode", f"must be one of {list(MODE_VALUES)}, got {spec['mode']!r}")
        s.mode = MODE_VALUES[spec["mode"]]
    if spec.get("children") is not None:
        if not isinstance(spec["children"], str) or spec["children"] not in CHILDREN_VALUES:
            raise invalid("speculation.children",
                          f"must be one of {list(CHILDREN_VALUES)}, got {spec['children']!r}")
        s.children = CHILDREN_VALUES[spec["children"]]
    expansion = spec.get("expansion")
    if expansion is not None:
        if not (isinstance(expansion, list) and all(isinstance(k, int) and not isinstance(k, bool) for k in expansion)
                and all(-2**31 <= k < 2**31 for k in expansion)):
            raise invalid("speculation.expansion", f"must be a list of integers, got {expansion!r}", "invalid_type")
        s.expansion.extend(expansion)
    ssms = spec.get("ssms")
    if ssms is not None:
        if not (isinstance(ssms, list) and all(isinstance(name, str) for name in ssms)):
            raise invalid("speculation.ssms", f"must be a list of SSM names, got {ssms!r}", "invalid_type")
        s.ssms.extend(_text(name, f"speculation.ssms[{index}]") for index, name in enumerate(ssms))
    depth = _integer(spec, "sequence_depth", "speculation.sequence_depth")
    if depth is not None:
        _assign(s, "sequence_depth", depth, "speculation.sequence_depth")
    if spec.get("adaptive") is not None:
        if not isinstance(spec["adaptive"], bool):
            raise invalid("speculation.adaptive", f"must be true or false, got {spec['adaptive']!r}", "invalid_type")
        s.adaptive = spec["adaptive"]
    prefetch = _integer(spec, "prefetch", "speculation.prefetch")
    if prefetch is not None:
        _assign(s, "prefetch", prefetch, "speculation.prefetch")


def _assign(message, field: str, value, param: str) -> None:
    try:
        setattr(message, field, value)
    except (ValueError, TypeError) as error:  # out of the protobuf field's range
        raise invalid(param, f"out of range: {error}") from None


def _sampling(body: dict, request: pb.GenerateRequest, max_tokens: int | None, max_tokens_param: str) -> None:
    if max_tokens is not None:
        _assign(request, "max_new_tokens", max_tokens, max_tokens_param)
    for key in ("temperature", "top_p"):
        value = _number(body, key)
        if value is not None:
            setattr(request, key, value)
    for key in ("top_k", "seed"):
        value = _integer(body, key)
        if value is not None:
            _assign(request, key, value, key)
    request.stop.extend(_stop(body))
    _speculation(body, request)


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid("stream_options", f"must be an object, got {options!r}", "invalid_type")
    return stream and _boolean(options, "include_usage")


def completion_call(body: Any, model_name: str) -> ParsedCall:
    """A /v1/completions body -> ParsedCall; raises OpenAIError."""
    body = _object(body)
    check_model(body, model_name)
    check_unsupported(body, COMPLETION_UNSUPPORTED)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise invalid("prompt", f"one prompt per request ({len(prompt)} given)", "unsupported_parameter")
    if isinstance(prompt, list) and prompt:
        raise invalid("prompt", "token-id prompts are not supported; send text", "unsupported_parameter")
    if not isinstance(prompt, str):
        raise invalid("prompt", f"must be a string, got {prompt!r}", "invalid_type")
    request = pb.GenerateRequest(prompt=_text(prompt, "prompt"))
    _sampling(body, request, _integer(body, "max_tokens"), "max_tokens")
    stream = _boolean(body, "stream")
    return ParsedCall(request, False, stream, _stream_options(body, stream), _boolean(body, "return_token_ids"),
                      "max_tokens")


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return _text(content, f"messages[{index}].content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise invalid(f"messages[{index}].content", f"only text parts are supported, got {part!r}",
                              "unsupported_parameter")
            texts.append(_text(part["text"], f"messages[{index}].content"))
        return "\n".join(texts)
    raise invalid(f"messages[{index}].content", f"must be a string or a list of text parts, got {content!r}",
                  "invalid_type")


def chat_call(body: Any, model_name: str) -> ParsedCall:
    """A /v1/chat/completions body -> ParsedCall; raises OpenAIError."""
    body = _object(body)
    check_model(body, model_name)
    check_unsupported(body, CHAT_UNSUPPORTED)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", f"must be a non-empty list of messages, got {messages!r}",
                      "invalid_type" if not isinstance(messages, list) else "invalid_value")
    request = pb.GenerateRequest()
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{index}]", f"must be an object, got {message!r}", "invalid_type")
        role = message.get("role")
        if not isinstance(role, str):
            raise invalid(f"messages[{index}].role", f"must be a string, got {role!r}", "invalid_type")
        request.messages.add(role=_text(role, f"messages[{index}].role"), content=_content(message, index))
    param = "max_completion_tokens" if _present(body, "max_completion_tokens") else "max_tokens"
    _sampling(body, request, _integer(body, param), param)
    stream = _boolean(body, "stream")
    return ParsedCall(request, True, stream, _stream_options(body, stream), _boolean(body, "return_token_ids"), param)


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def invalid_argument(error: InvalidArgument, call: ParsedCall) -> OpenAIError:
    """The server's field check, under the OpenAI parameter name."""
    field = error.field
    if field == "max_new_tokens":
        field = call.max_tokens_param
    elif field == "prompt" and call.chat:
        field = "messages"
    return invalid(field, error.message)


def error_for(error: BaseException, call: ParsedCall) -> OpenAIError:
    """The HTTP answer to an exception raised by the ingress (its metrics status, as HTTP)."""
    if isinstance(error, InvalidArgument):
        return invalid_argument(error, call)
    status = status_name(error)
    if status == "RESOURCE_EXHAUSTED":
        return OpenAIError(429, status_details(error), code="server_busy")
    if status == "UNAVAILABLE":
        return OpenAIError(503, status_details(error), code="unavailable")
    return OpenAIError(HTTP_STATUS.get(status, 500), status_details(error), code="internal_error")


# --- responses ----------------------------------------------------------------------------


def speculation_usage(stats) -> dict:
    """engine.generate.GenerationStats as the ``usage.speculation`` object."""
    return {"mode": stats.mode, "target_steps": stats.target_steps, "tokens_per_step": stats.tokens_per_step,
            "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
            "accepted_per_ssm": dict(stats.accepted_per_proposer),
            "accepted_per_depth": list(stats.accepted_per_depth), "ms_per_token": stats.ms_per_token,
            "draft_ms": stats.draft_ms, "verify_ms": stats.verify_ms, "total_ms": stats.total_ms,
            "hop_ms": dict(stats.hop_ms), "tree_sizes": list(stats.tree_sizes),
            "prefetch_hits": stats.prefetch_hits, "prefetch_misses": stats.prefetch_misses,
            "prefetch_saved_ms": stats.prefetch_saved_ms,
            "drafted_through_text": {name: counts[0] for name, counts in stats.translated_per_proposer.items()},
            "survived_through_text": {name: counts[1] for name, counts in stats.translated_per_proposer.items()}}


def usage(observation: RequestObservation, stats) -> dict:
    prompt = observation.prompt_tokens or 0
    completion = stats.new_tokens if stats is not None else 0
    block = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if stats is not None:
        block["speculation"] = speculation_usage(stats)
    return block


def finish_name(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS.get(reason, reason)


class Responder:
    """Builds one request's response objects (ids, timestamps, the two APIs' shapes)."""

    def __init__(self, call: ParsedCall, model: str):
        self.call, self.model = call, model
        self.id = ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def full(self, text: str, token_ids: list[int], reason: str | None, usage_block: dict) -> dict:
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": finish_name(reason)}
        if self.call.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.call.return_token_ids:
            choice["token_ids"] = token_ids
        return self._envelope("chat.completion" if self.call.chat else "text_completion", [choice],
                              usage=usage_block)

    def chunk(self, text: str | None, token_ids, reason: str | None, role: bool = False) -> dict:
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": finish_name(reason)}
        if self.call.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if self.call.return_token_ids and token_ids is not None:
            choice["token_ids"] = list(token_ids)
        extra = {"usage": None} if self.call.include_usage else {}
        return self._envelope("chat.completion.chunk" if self.call.chat else "text_completion", [choice], **extra)

    def usage_chunk(self, usage_block: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.call.chat else "text_completion", [],
                              usage=usage_block)


def sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


# --- the app ------------------------------------------------------------------------------


def build_app(ingress) -> FastAPI:
    """The FastAPI app of one ingress replica (``SpecInferIngress.__serve_build_asgi_app__``).

    ``ingress`` provides ``config`` (the served model's name), ``generate_updates(request,
    context, observation)``, the async generator of engine StepUpdates the gRPC methods use,
    ``health()`` (an ``actors.liveness.HealthReport``) and ``auth_token`` (None: auth off).
    """
    app = FastAPI(title="specinfer OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    model_name = ingress.config.target.name
    started = int(time.time())
    token = ingress.auth_token

    def authenticated(request: Request) -> None:
        """The /v1 routes' bearer check (cluster.auth); /health is exempt."""
        try:
            check_header(request.headers.get("authorization"), token)
        except Unauthenticated as error:
            raise OpenAIError(401, str(error), code="invalid_api_key") from None

    v1 = [Depends(authenticated)]

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, error: OpenAIError):
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        return OpenAIError(error.status_code, str(error.detail), code="not_found" if error.status_code == 404
                           else None).response()

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "specinfer"}

    @app.get("/v1/models", dependencies=v1)
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=v1)
    async def get_model(model: str):
        check_model({"model": model}, model_name)
        return model_card()

    @app.get("/health")
    async def health():
        """200 while every model actor answers, 503 while one is dead or restarting or the replica drains."""
        report = await ingress.health()
        status = "serving" if report.serving else "draining" if report.draining else "not serving"
        return JSONResponse({"status": status, "down": list(report.down)}, status_code=200 if report.serving else 503)

    async def read_json(request: Request) -> Any:
        try:
            return await request.json()
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser's stack
            raise OpenAIError(400, "the request body is not valid JSON", code="invalid_json") from None

    def parse(parser, body: Any) -> ParsedCall:
        """The request, or its 400/404 -- counted like the ingress counts refused gRPC requests."""
        try:
            return parser(body, model_name)
        except OpenAIError as error:
            metrics = getattr(ingress, "metrics", None)
            if metrics is not None:
                observation = RequestObservation("openai")
                observation.finish(STATUS_OF_HTTP.get(error.status, "INVALID_ARGUMENT"))
                metrics.record(observation)
            raise

    async def answer(call: ParsedCall):
        responder = Responder(call, model_name)
        observation = RequestObservation("openai")
        updates = ingress.generate_updates(call.request, None, observation)
        if call.stream:
            return await stream(call, responder, observation, updates)
        text, token_ids, last = [], [], None
        try:
            async with aclosing(updates):
                async for update in updates:
                    text.append(update.text)
                    token_ids.extend(update.token_ids)
                    last = update
        except Exception as error:
            raise error_for(error, call) from None
        return responder.full("".join(text), token_ids, last.finish_reason, usage(observation, last.stats))

    async def stream(call: ParsedCall, responder: Responder, observation: RequestObservation, updates):
        # Pull the first update (the prefill's token) before answering, so that a request the
        # server refuses (bad field, overload) gets its HTTP status rather than a 200 stream.
        try:
            first = await updates.__anext__()
        except Exception as error:
            await updates.aclose()
            raise error_for(error, call) from None

        async def events() -> AsyncIterator[str]:
            async with aclosing(updates):
                if call.chat:
                    yield sse(responder.chunk("", None, None, role=True))
                update = last = first
                try:
                    while True:  # to the generator's end, so that it finishes (and counts) as OK
                        last = update
                        if update.text or update.finish_reason is not None or (call.return_token_ids
                                                                                and update.token_ids):
                            yield sse(responder.chunk(update.text, update.token_ids, update.finish_reason))
                        try:
                            update = await updates.__anext__()
                        except StopAsyncIteration:
                            break
                except Exception as error:  # after the 200: the error is an event, then the stream ends
                    yield sse(error_for(error, call).body())
                    yield sse("[DONE]")
                    return
                if call.include_usage:
                    yield sse(responder.usage_chunk(usage(observation, last.stats)))
                yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request):
        return await answer(parse(completion_call, await read_json(request)))

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: Request):
        return await answer(parse(chat_call, await read_json(request)))

    return app

