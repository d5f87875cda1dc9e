"""The engine's exceptions, in one module that imports nothing of the engine (so every layer can raise and catch
them without an import cycle).

- ``InvalidRequestError`` (a ``ValueError``): the request broke a documented bound; the server answers 400 with
  ``param`` naming the field. Raised only by the input processor, before anything is queued.
- ``QueueFullError``: the admission queue (``--max-num-queued-reqs`` / ``--max-num-queued-tokens``) is full; the
  server answers 429 with ``Retry-After``.
- ``RequestFailedError``: processing that belongs to one request (hashing, detokenizing, stop strings, logprobs)
  raised inside the engine; only that request fails (500), the batch runs on.
- ``EngineDeadError``: the engine loop has stopped (a fault that can't be attributed to one request, e.g. the model
  forward, or shutdown); every request gets it (503).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["EngineDeadError", "EngineShuttingDownError", "InvalidRequestError", "QueueFullError",
           "RequestFailedError"]


class InvalidRequestError(ValueError):
    """A request field is out of its bound. ``param``: the field's name (OpenAI's ``error.param``)."""

    def __init__(self, message: str, param: Optional[str] = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class QueueFullError(RuntimeError):
    """The admission queue is full; ``retry_after_s`` is a hint for the client (HTTP ``Retry-After``)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailedError(RuntimeError):
    """One request's own processing raised inside the engine; the request is ended, the engine runs on."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (it crashed or was shut down); no request can be served."""


class EngineShuttingDownError(RuntimeError):
    """The server is draining for shutdown: no new request is admitted (503)."""
