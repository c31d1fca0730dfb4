"""GET / and /playground: a static page (plain HTML/CSS/JS next to this file, no build step, nothing from another
origin) that talks to this server's own /v1 routes. The page and its assets hold no data, so they are served
without the API key; /v1 still asks for it. A strict CSP keeps the page to its own files and its own origin."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from vlserve.server.errors import error_response

PAGE_DIR = Path(__file__).parent
# name -> content type: the only files served (nothing else in this folder is reachable)
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "auth.js": "text/javascript; charset=utf-8",
    "media.js": "text/javascript; charset=utf-8",
    "request.js": "text/javascript; charset=utf-8",
    "sse.js": "text/javascript; charset=utf-8",
    "stats.js": "text/javascript; charset=utf-8",
    "snippets.js": "text/javascript; charset=utf-8",
}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "media-src 'self' data: blob:; connect-src 'self'; object-src 'none'; frame-ancestors 'none'; "
       "base-uri 'none'; form-action 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


def playground_config(server, limit_mm_per_prompt: dict[str, int]) -> dict:
    """What the page checks a request against before sending it (the server checks again): no model name or other
    detail that /v1 keeps behind the key."""
    return {"auth_required": bool(server.api_key),
            "limits": {"max_media_bytes": server.max_media_bytes, "max_video_bytes": server.max_video_bytes,
                       "max_request_bytes": server.max_request_bytes, "mm_per_prompt": dict(limit_mm_per_prompt)}}


def add_playground(app: FastAPI, config: dict) -> None:
    files = {name: (PAGE_DIR / name).read_bytes() for name in ASSETS}  # read once, at start-up

    async def page():
        return Response(files["index.html"], media_type=ASSETS["index.html"], headers=HEADERS)

    app.get("/", include_in_schema=False)(page)
    app.get("/playground", include_in_schema=False)(page)

    @app.get("/playground/{name}", include_in_schema=False)
    async def asset(name: str):
        if name == "config.json":
            return JSONResponse(config, headers=HEADERS)
        if name not in ASSETS:
            return error_response(f"no playground file {name!r}", 404)
        return Response(files[name], media_type=ASSETS[name], headers=HEADERS)
