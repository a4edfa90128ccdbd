"""/docs served from local Swagger UI assets, so the docs work on hosts without internet access.

FastAPI's default /docs page loads Swagger UI from a CDN; a serving host is often firewalled. The
assets come from the `swagger-ui-bundle` package (the `serve` extra) and are mounted under
/docs-assets. Without that package the CDN page is kept (and a warning says why).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

logger = logging.getLogger(__name__)

ASSETS = "/docs-assets"


def local_swagger_ui_dir() -> str | None:
    """The directory of the bundled Swagger UI, or None when swagger-ui-bundle is not installed."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    return str(swagger_ui_path)


def install_docs(app: FastAPI) -> None:
    """GET /docs (Swagger UI over /openapi.json), from local assets when they are installed."""
    assets, urls = local_swagger_ui_dir(), {}
    if assets is None:
        logger.warning("swagger-ui-bundle is not installed: /docs loads Swagger UI from a CDN")
    else:
        app.mount(ASSETS, StaticFiles(directory=assets), name="docs-assets")
        urls = {
            "swagger_js_url": f"{ASSETS}/swagger-ui-bundle.js",
            "swagger_css_url": f"{ASSETS}/swagger-ui.css",
            "swagger_favicon_url": f"{ASSETS}/favicon-32x32.png",
        }

    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=app.title, **urls)

    app.add_api_route("/docs", docs, include_in_schema=False, response_class=HTMLResponse)
