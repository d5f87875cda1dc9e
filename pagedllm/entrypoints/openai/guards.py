"""Two ASGI middlewares that run before any route (plain ASGI, not ``BaseHTTPMiddleware``, so streaming and
disconnect detection pass through untouched):

- ``ApiKeyAuth``: with ``--api-key`` every route but ``/health`` (and ``/metrics`` with
  ``--allow-unauthenticated-metrics``) needs ``Authorization: Bearer <key>`` for one of the keys (401 otherwise);
  keys are compared in constant time.
- ``BodyGuard``: the request body is read (at most ``--max-request-body-bytes``; past it a 413, checked from
  ``Content-Length`` before reading and while reading, so nothing is parsed) and checked for strings UTF-8 can't
  encode: JSON's ``\\uXXXX`` escapes can spell a lone UTF-16 surrogate, which Python decodes and every encoder
  refuses later. Such a body gets a 400 naming the field (``param``: the top-level field; the message: the path).
  The scan is a byte search for a surrogate escape first, so ordinary bodies are not parsed twice.
"""

from __future__ import annotations

import hmac
import json
import re
from typing import Iterable, Optional

from pagedllm.engine.input_processor import find_unencodable

__all__ = ["ApiKeyAuth", "BodyGuard", "load_api_keys"]

# A JSON escape of a UTF-16 surrogate (U+D800..U+DFFF); a valid pair decodes to one character, a lone one doesn't.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


async def _send_json(send, status: int, body: dict, headers: Optional[list] = None) -> None:
    data = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])})
    await send({"type": "http.response.body", "body": data})


def _error(message: str, err_type: str, param: Optional[str], code: Optional[str]) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def load_api_keys(keys: Optional[Iterable[str]], key_file: Optional[str] = None) -> list[str]:
    """The accepted keys: ``keys`` (``--api-key``, repeatable) plus one per non-empty, non-``#`` line of
    ``key_file``. Raises ValueError for an empty key."""
    out = [k for k in (keys or []) if k is not None]
    if key_file:
        with open(key_file, encoding="utf-8") as f:
            out.extend(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
    for k in out:
        if not k.strip():
            raise ValueError("api keys must not be empty.")
    return out


class ApiKeyAuth:
    def __init__(self, app, api_keys: Iterable[str], open_paths: Iterable[str] = ("/health",)) -> None:
        self.app = app
        self.expected = [f"Bearer {k}".encode() for k in api_keys]
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        got = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                got = value
                break
        ok = False
        for exp in self.expected:  # every key is compared (constant time per key), whatever matched first
            ok |= hmac.compare_digest(got, exp)
        if not ok:
            return await _send_json(send, 401, _error("Incorrect API key provided.", "authentication_error", None,
                                                      "invalid_api_key"),
                                    [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyGuard:
    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def _too_large(self, send, what: str) -> None:
        await _send_json(send, 413, _error(f"The request body is {what}, more than --max-request-body-bytes="
                                           f"{self.max_body_bytes}.", "invalid_request_error", None,
                                           "request_too_large"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await _send_json(send, 400, _error("Invalid Content-Length.", "invalid_request_error",
                                                              None, "invalid_value"))
                if declared > limit:
                    return await self._too_large(send, f"{declared} bytes")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone; nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await self._too_large(send, f"over {limit} bytes")
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if _SURROGATE_ESCAPE.search(body):
            try:
                obj = json.loads(body)
            except (ValueError, RecursionError):
                obj = None  # not JSON: the route's own parser answers 400
            where = find_unencodable(obj) if obj is not None else None
            if where is not None:
                param = where.split(".", 1)[0]
                return await _send_json(send, 400, _error(
                    f"{where} must be valid UTF-8 text: it holds a lone UTF-16 surrogate.", "invalid_request_error",
                    param, "invalid_encoding"))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls: disconnect detection

        return await self.app(scope, replay, send)
