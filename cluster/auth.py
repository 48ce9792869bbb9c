"""Optional bearer-token authentication for the gRPC methods and the OpenAI routes.

Off by default. On when the environment variable named by ``server.auth_token_env`` (default
``SPECINFER_AUTH_TOKEN``; the k8s overlay fills it from a Secret) is set and non-empty in the
ingress replica's environment. Then gRPC ``Generate`` / ``GenerateStream`` need the metadata
``authorization: Bearer <token>`` (else UNAUTHENTICATED) and HTTP ``/v1/*`` the header
``Authorization: Bearer <token>`` (else 401); ``grpc.health.v1`` and ``GET /health`` are exempt.
Tokens are compared with ``hmac.compare_digest``.

    token = auth_token(config.server)          # None: auth off
    authorized("Bearer s3cret", "s3cret")      # True
"""

from __future__ import annotations

import hmac
import os
from typing import Iterable

from settings.config import ServerConfig

SCHEME = "bearer"


class Unauthenticated(Exception):
    """A request without the right bearer token; ``str()`` says what was missing."""


def auth_token(server: ServerConfig, environ=os.environ) -> str | None:
    """The token from the environment variable ``server.auth_token_env`` names, or None (auth off)."""
    if not server.auth_token_env:
        return None
    return environ.get(server.auth_token_env) or None


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <token>`` (scheme case-insensitive)."""
    if not header:
        return False
    scheme, _, credentials = header.strip().partition(" ")
    if scheme.lower() != SCHEME:
        return False
    return hmac.compare_digest(credentials.strip().encode("utf-8", "surrogateescape"),
                               token.encode("utf-8", "surrogateescape"))


def check_metadata(metadata: Iterable[tuple[str, str]], token: str | None) -> None:
    """Raise Unauthenticated unless auth is off or the gRPC metadata carries the token."""
    values = [value for key, value in metadata if key.lower() == "authorization"]
    _check(values, token, "metadata 'authorization: Bearer <token>'")


def check_header(header: str | None, token: str | None) -> None:
    """Raise Unauthenticated unless auth is off or the HTTP ``Authorization`` header carries the token."""
    _check([header] if header else [], token, "header 'Authorization: Bearer <token>'")


def _check(values: list[str], token: str | None, where: str) -> None:
    if token is None:
        return
    if not values:
        raise Unauthenticated(f"missing {where}")
    if not any(authorized(value, token) for value in values):
        raise Unauthenticated(f"invalid bearer token in {where}")
