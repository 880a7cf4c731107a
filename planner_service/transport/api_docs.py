"""Offline API documentation (/docs Swagger UI, /redoc ReDoc) and the OpenAPI request examples.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so on an air-gapped cluster they stay
blank. Here both pages reference only this server: the JavaScript, CSS and favicon come from the
`fastapi-offline` distribution (MIT; it bundles Swagger UI's and ReDoc's standalone builds), a
pinned dependency installed with the package (pyproject.toml, requirements.lock), served as
static files under /docs/assets. Nothing is fetched at run time, and ReDoc runs without its
Google fonts (docs/design/service.md).
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["ASSETS_URL", "add_docs", "assets_dir", "ROLLOUT_EXAMPLES", "TOPOLOGY_EXAMPLES"]

ASSETS_URL = "/docs/assets"

_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")


def assets_dir() -> Path:
    """Folder of the vendored Swagger UI / ReDoc files; FileNotFoundError names the missing one."""
    folder = Path(str(resources.files("fastapi_offline") / "static"))
    for name in _FILES:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name}: the documentation assets are incomplete; "
                                    "reinstall the pinned fastapi-offline (requirements.lock)")
    return folder


def add_docs(app: FastAPI, *, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Serve Swagger UI at `docs_url` and ReDoc at `redoc_url` from local assets (the app must be
    created with docs_url=None, redoc_url=None)."""
    app.mount(ASSETS_URL, StaticFiles(directory=assets_dir()), name="docs_assets")
    openapi_url = app.openapi_url
    oauth2_url = f"{docs_url}/oauth2-redirect"

    @app.get(docs_url, include_in_schema=False, name="docs")
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url, title=f"{app.title} - Swagger UI", oauth2_redirect_url=oauth2_url,
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js", swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_URL}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},  # no calls to the public validator either
        )

    @app.get(oauth2_url, include_in_schema=False, name="docs_oauth2_redirect")
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(redoc_url, include_in_schema=False, name="redoc")
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=openapi_url, title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{ASSETS_URL}/favicon.png", with_google_fonts=False)


#: Request examples of POST /v1/steps (docs/rollouts.md); the tests submit each one.
ROLLOUT_EXAMPLES = {
    "flat": {
        "summary": "Flat trajectories (the service merges shared prefixes)",
        "value": {
            "batch_id": "step-0",
            "vocab_size": 256,
            "trajectories": [
                {"id": "a", "tree_id": "task-1", "tokens": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 0, 1, 1],
                 "old_logprobs": [0, 0, 0, -1.2, -0.7], "advantage": 1.0, "group_id": "task-1"},
                {"id": "b", "tree_id": "task-1", "tokens": [5, 6, 7, 3], "loss_mask": [0, 0, 0, 1],
                 "old_logprobs": [0, 0, 0, -2.1], "advantage": -1.0, "group_id": "task-1"},
            ],
        },
    },
    "tree": {
        "summary": "An explicit tree (nodes with parents; trajectories end at a node)",
        "value": {
            "batch_id": "step-1",
            "vocab_size": 256,
            "trees": [{
                "id": "task-7",
                "nodes": [{"id": 0, "parent": None, "tokens": [5, 6, 7]},
                          {"id": 1, "parent": 0, "tokens": [8, 9]},
                          {"id": 2, "parent": 0, "tokens": [3]}],
                "trajectories": [{"id": "a", "node": 1, "loss_mask": [0, 0, 0, 1, 1], "advantage": 1.0},
                                 {"id": "b", "node": 2, "loss_mask": [0, 0, 0, 1], "advantage": -1.0}],
            }],
        },
    },
}

#: Request examples of POST /v1/steps/{step_id}/plan.
TOPOLOGY_EXAMPLES = {
    "two-ranks": {
        "summary": "Two trainer ranks, 4,096-token microbatches joined by sharing windows",
        "value": {"world_size": 2, "microbatch_tokens": 4096, "chunk_size": 64},
    },
    "lockstep": {
        "summary": "Four FSDP2 ranks that gather parameters per forward and backward: lock-step phases",
        "value": {"world_size": 4, "microbatch_tokens": 4096, "lockstep": True},
    },
    "defaults": {
        "summary": "Eight ranks, every other budget at the service default",
        "value": {"world_size": 8},
    },
}
