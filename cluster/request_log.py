"""A request id on every log line the ingress writes while it serves a request.

The ingress sets the id for the request (``with request_logging(request_id):``); a log record
factory installed once per process (``install()``) appends `` request_id=<id>`` to the message
of every record created while it is set, whatever the logger (ours, engine, transformers). The
id is a context variable, so concurrent requests on one event loop keep their own ids. Ray's
own loggers (``ray.*``) are left alone: Serve's formatter already carries its request id.

    install()
    with request_logging("3f2a..."):
        logger.info("admitted")          # -> "admitted request_id=3f2a..."
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

REQUEST_ID: ContextVar[str | None] = ContextVar("specinfer_request_id", default=None)
_installed = False


def install() -> None:
    """Wrap the process's log record factory (idempotent)."""
    global _installed
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        request_id = REQUEST_ID.get()
        if request_id is not None and isinstance(record.msg, str) and not record.name.startswith("ray."):
            record.msg = f"{record.msg} request_id={request_id}"
        return record

    logging.setLogRecordFactory(factory)
    _installed = True


@contextmanager
def request_logging(request_id: str) -> Iterator[None]:
    """Tag log records with ``request_id`` inside the block.

    Cleared with ``set(None)`` rather than a token reset: a streamed response may finish the
    block in another task's context than the one it started in.
    """
    REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.set(None)
