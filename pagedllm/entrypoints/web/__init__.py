"""The server's built-in web pages and the dashboard's JSON.

- ``GET /`` and ``GET /ui``: the chat playground; ``GET /dashboard``: live charts of the engine. Both are static
  files in ``static/`` (plain HTML/CSS/JS ES modules, no build step, nothing fetched from another origin), served
  from memory under ``/ui/static/<name>``.
- ``GET /stats``: the dashboard's data (``stats.StatsSampler``), derived from the same counters as ``/metrics``.

Auth: with an API key, ``/stats`` (like ``/v1/*``) needs ``Authorization: Bearer <key>`` (401 otherwise). The HTML
shells and their scripts hold no data and load without the key (a browser's navigation can't send a Bearer header);
the pages then ask for the key, keep it in the browser's localStorage, and send it with every API call.
``is_public_path`` names those paths for an auth layer that covers every route.

``--disable-frontend`` drops the pages and their assets (404); ``/stats`` stays, like ``/metrics``.
"""

from __future__ import annotations

import math
import secrets
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Optional, Sequence, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.serving_engine import OpenAIServingError, error_body
from pagedllm.entrypoints.web.stats import StatsSampler

__all__ = ["ASSET_PREFIX", "PAGE_PATHS", "PUBLIC_PATHS", "STATIC_DIR", "build_web_router", "is_public_path"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
PAGE_PATHS = {"/": "index.html", "/ui": "index.html", "/ui/": "index.html", "/dashboard": "dashboard.html"}
ASSET_PREFIX = "/ui/static/"

_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
# Only our own scripts and styles run; no inline script (so an event handler attribute that slipped into the DOM
# still can't run), no frames, no other origin. The pages build every node from model text with textContent.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                 "Cache-Control": "no-cache"}


def is_public_path(path: str) -> bool:
    """True for the pages and their static assets (no data; they ask for the API key themselves)."""
    return path in PAGE_PATHS or path.startswith(ASSET_PREFIX)


# The same as exact paths, for an auth layer that takes a set of open paths.
PUBLIC_PATHS = frozenset(PAGE_PATHS) | frozenset(ASSET_PREFIX + p.name for p in STATIC_DIR.iterdir() if p.is_file())


def _load_assets() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, content type) for every file directly in ``STATIC_DIR`` (a fixed set: no path is ever joined
    from a request)."""
    out = {}
    for p in sorted(STATIC_DIR.iterdir()):
        ctype = _CONTENT_TYPES.get(p.suffix)
        if p.is_file() and ctype is not None:
            out[p.name] = (p.read_bytes(), ctype)
    return out


def _unauthorized() -> JSONResponse:
    return JSONResponse(error_body("Incorrect API key provided.", "authentication_error", None, "invalid_api_key"),
                        status_code=401, headers={"WWW-Authenticate": "Bearer"})


def build_web_router(engine, api_key: Union[None, str, Sequence[str]] = None, enable_frontend: bool = True,
                     version: str = "", sampler: Optional[StatsSampler] = None) -> APIRouter:
    """The pages (unless ``enable_frontend`` is False) and ``GET /stats`` over ``engine`` (an ``AsyncLLM``).

    Args:
        api_key: one key or several; when set, ``/stats`` needs ``Authorization: Bearer <key>``.
        version: the server's version, shown on the dashboard.
        sampler: the ``StatsSampler`` to serve (default: a new one, 1 s samples, 5 minutes kept); it runs while the
            app's lifespan does (and starts on the first ``/stats`` if the lifespan never ran).
    """
    keys = [api_key] if isinstance(api_key, str) else [k for k in (api_key or ()) if k]
    expected = [f"Bearer {k}".encode() for k in keys]
    sampler = sampler if sampler is not None else StatsSampler(engine, version=version)

    @asynccontextmanager
    async def lifespan(_app):
        sampler.start()
        try:
            yield
        finally:
            await sampler.stop()

    router = APIRouter(lifespan=lifespan)
    router.stats_sampler = sampler  # for tests and embedders

    def authorized(request: Request) -> bool:
        if not expected:
            return True
        got = request.headers.get("authorization", "").encode()
        ok = False
        for e in expected:  # no early exit: the time doesn't tell which key came close
            ok |= secrets.compare_digest(got, e)
        return ok

    @router.get("/stats", include_in_schema=True, summary="Engine statistics for the dashboard (JSON)")
    async def stats(request: Request, since: Optional[str] = None):
        """``since``: Unix seconds; only newer points are returned in ``series``."""
        if not authorized(request):
            return _unauthorized()
        t_since = None
        if since is not None:
            try:
                t_since = float(since)
            except ValueError:
                t_since = math.nan
            if not math.isfinite(t_since):
                raise OpenAIServingError(f"since must be a finite number of Unix seconds, got {since[:40]!r}.", 400,
                                         param="since", code="invalid_value")
        sampler.start()
        return JSONResponse(sampler.to_dict(t_since), headers={"Cache-Control": "no-store"})

    if not enable_frontend:
        return router
    assets = _load_assets()

    def page(name: str):
        body, ctype = assets[name]

        async def serve_page():
            return Response(body, media_type=ctype, headers=_PAGE_HEADERS)

        return serve_page

    for path, name in PAGE_PATHS.items():
        router.add_api_route(path, page(name), methods=["GET"], include_in_schema=False)

    @router.get(ASSET_PREFIX + "{name}", include_in_schema=False)
    async def asset(name: str):
        hit = assets.get(name)
        if hit is None:
            return JSONResponse(error_body(f"No such file: {name}", "not_found_error"), status_code=404)
        body, ctype = hit
        return Response(body, media_type=ctype, headers={"X-Content-Type-Options": "nosniff",
                                                         "Cache-Control": "no-cache"})

    return router
