"""Optional bearer-token authentication for the gRPC methods and the OpenAI routes.

Off by default. On when the environment variable named by ``server.auth_token_env`` (default
``SPECINFER_AUTH_TOKEN``) is set and non-empty in the ingress replica's environment, or when
``server.auth_token_file`` names a file (the k8s overlay mounts a Secret there). Then gRPC
``Generate`` / ``GenerateStream`` need the metadata ``authorization: Bearer <token>`` (else
UNAUTHENTICATED) and HTTP ``/v1/*`` the header ``Authorization: Bearer <token>`` (else 401);
``grpc.health.v1`` and ``GET /health`` are exempt.

Several tokens may be accepted at once (any one matches), so that clients can move to a new token
before the old one is dropped: the variable may list them separated by commas, the file one per
line (blank lines and ``#`` comments skipped). The file is checked on every request (one ``stat``)
and read again when its inode, size or modification time changed: Kubernetes updates a mounted
Secret by swapping a symlink to a new directory, so a rotated token applies without a restart. An
unreadable or empty file leaves only the variable's tokens; with none, every request is refused.
Tokens are compared with ``hmac.compare_digest``.

    tokens = auth_token(config.server)             # None: auth off; else a TokenSource
    authorized("Bearer s3cret", "s3cret")          # True
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import threading
from pathlib import Path
from typing import Iterable

from settings.config import ServerConfig

SCHEME = "bearer"
_SEPARATORS = re.compile(r"[\s,]+")  # RFC 6750's b64token has neither
logger = logging.getLogger(__name__)


class Unauthenticated(Exception):
    """A request without the right bearer token; ``str()`` says what was missing."""


def parse_tokens(text: str) -> tuple[str, ...]:
    """The tokens in a variable's value or a file's text: separated by commas or white space, ``#``
    starting a comment to the end of its line; duplicates dropped, order kept."""
    words = [w for line in text.splitlines() for w in _SEPARATORS.split(line.split("#", 1)[0]) if w]
    return tuple(dict.fromkeys(words))


class TokenSource:
    """The bearer tokens accepted now: fixed ones (the environment's, read at start) and those of a
    file, re-read when its (device, inode, size, mtime) changes. Safe to call from several threads."""

    def __init__(self, fixed: Iterable[str] = (), path: str | Path | None = None):
        self.fixed, self.path = tuple(fixed), None if path is None else Path(path).expanduser()
        self._key: tuple | None = None
        self._from_file: tuple[str, ...] = ()
        self._lock = threading.Lock()

    def current(self) -> tuple[str, ...]:
        """Every accepted token; () refuses every request."""
        return tuple(dict.fromkeys(self.fixed + self._file_tokens()))

    def _file_tokens(self) -> tuple[str, ...]:
        if self.path is None:
            return ()
        try:
            stat = os.stat(self.path)  # follows the Secret volume's symlinks to the current file
            key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except OSError as error:
            key = ("missing", type(error).__name__)
        with self._lock:
            if key != self._key:
                self._from_file = self._read(key)
                self._key = key
            return self._from_file

    def _read(self, key: tuple) -> tuple[str, ...]:
        try:
            tokens = parse_tokens(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as error:
            logger.warning("auth token file %s unreadable (%s): only the environment's tokens are accepted",
                           self.path, error)
            return ()
        logger.info("auth token file %s: %d tokens", self.path, len(tokens))
        return tokens


def auth_sources(server: ServerConfig, environ=os.environ) -> str:
    """Where the accepted tokens come from, for the log (never the tokens):
    ``$SPECINFER_AUTH_TOKEN and /etc/specinfer/auth/tokens``."""
    named = [f"${server.auth_token_env}"] if server.auth_token_env and environ.get(server.auth_token_env) else []
    return " and ".join(named + ([server.auth_token_file] if server.auth_token_file else [])) or "nowhere"


def auth_token(server: ServerConfig, environ=os.environ) -> TokenSource | None:
    """The accepted tokens (``server.auth_token_env``'s variable, ``server.auth_token_file``), or None
    when neither is configured and set (auth off)."""
    fixed = parse_tokens(environ.get(server.auth_token_env) or "") if server.auth_token_env else ()
    if not fixed and not server.auth_token_file:
        return None
    return TokenSource(fixed, server.auth_token_file)


def authorized(header: str | None, token: str | Iterable[str]) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <token>`` for ``token`` (or any of several;
    scheme case-insensitive). Every candidate is compared, so the time taken does not say which matched."""
    if not header:
        return False
    scheme, _, credentials = header.strip().partition(" ")
    if scheme.lower() != SCHEME:
        return False
    given = credentials.strip().encode("utf-8", "surrogateescape")
    tokens = (token,) if isinstance(token, str) else tuple(token)
    matches = [hmac.compare_digest(given, t.encode("utf-8", "surrogateescape")) for t in tokens]
    return any(matches)


def check_metadata(metadata: Iterable[tuple[str, str]], token: str | TokenSource | None) -> None:
    """Raise Unauthenticated unless auth is off or the gRPC metadata carries an accepted token."""
    values = [value for key, value in metadata if key.lower() == "authorization"]
    _check(values, token, "metadata 'authorization: Bearer <token>'")


def check_header(header: str | None, token: str | TokenSource | None) -> None:
    """Raise Unauthenticated unless auth is off or the HTTP ``Authorization`` header carries an accepted token."""
    _check([header] if header else [], token, "header 'Authorization: Bearer <token>'")


def _check(values: list[str], token: str | TokenSource | None, where: str) -> None:
    if token is None:
        return
    tokens = token.current() if isinstance(token, TokenSource) else (token,)
    if not values:
        raise Unauthenticated(f"missing {where}")
    if not tokens:
        raise Unauthenticated("no bearer token is accepted now (the server's token file is missing or empty)")
    if not any(authorized(value, tokens) for value in values):
        raise Unauthenticated(f"invalid bearer token in {where}")
