"""The web playground: static files of this package served at ``/ui/`` by the service itself.

Same origin as the API, so the page needs no CORS and sends the caller's key only to the
service that asked for it. Plain HTML, CSS and ES modules: nothing to build. The page
finds the API relative to its own URL, so it works under a Serve route prefix too.

Every answer carries a Content-Security-Policy that allows scripts and styles from this
origin only (no inline code, no ``eval``), media and images from ``blob:`` (the MP4 and the
running video's preview are fetched with the Bearer header and shown from a blob), and
nothing framed: a prompt that holds HTML would stay inert even if some code path ever put
it into markup.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import JSONResponse, RedirectResponse, Response

# The suffixes pyproject.toml's package-data installs (a new kind of file needs both).
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}
NAME = re.compile(r"^[a-z0-9_-]+\.(html|js|css)$")
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "media-src 'self' blob:; connect-src 'self'; form-action 'none'; base-uri 'none'; "
       "frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


@cache
def assets() -> dict[str, bytes]:
    """Every file of this package the page may load, read once (a fixed set: a request for
    any other name is a dictionary miss, never a path)."""
    root = resources.files(__package__)
    return {f.name: f.read_bytes() for f in root.iterdir() if f.is_file() and NAME.match(f.name)}


def asset(name: str) -> bytes | None:
    return assets().get(name)


def _answer(name: str) -> Response:
    body = asset(name)
    if body is None:
        return JSONResponse({"error": {"message": f"no UI file {name!r}", "type": "invalid_request_error",
                                       "param": None, "code": "not_found"}}, status_code=404)
    return Response(body, media_type=TYPES["." + name.rsplit(".", 1)[1]], headers=HEADERS)


def register(app: FastAPI) -> None:
    """Add ``/ui`` (a redirect), ``/ui/`` (the page) and ``/ui/{name}`` to ``app``; none of
    them is in the OpenAPI schema (they are not the API) and none needs a key (the page
    holds no data: everything it shows comes from the API calls it makes with the key)."""

    @app.get("/ui", include_in_schema=False)
    def ui_root() -> Response:
        # Relative, so a route prefix is kept: /prefix/ui -> /prefix/ui/
        return RedirectResponse("ui/", status_code=308)

    @app.get("/ui/", include_in_schema=False)
    def ui_page() -> Response:
        return _answer("index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    def ui_file(name: str) -> Response:
        return _answer(name)
