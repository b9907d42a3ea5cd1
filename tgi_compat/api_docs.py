"""The API's own documentation, as TGI serves it: `GET /api-doc/openapi.json` and the Swagger
UI at `GET /docs`.

``openapi.json`` beside this module is TGI 3.3's document made valid OpenAPI 3.0.3 (TGI writes
3.1-style numeric `exclusiveMinimum` and string-typed defaults) and fitted to our routes:
`GET /` and `/ping`, the legacy `/info` fields, the JSON body errors (400/401/413/415),
`model` and `adapter_id` as we treat them. The Swagger UI's JavaScript and CSS come from the
`swagger-ui-bundle` package and are served by the app itself: no network is needed.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response
from starlette.routing import Route

from .responses import JSONBytesResponse
from .settings import ServerSettings

OPENAPI_PATH = Path(__file__).with_name("openapi.json")
# Swagger UI files the /docs page loads, served from the swagger-ui-bundle package under /docs/.
ASSETS = {"swagger-ui.css": "text/css", "swagger-ui-bundle.js": "text/javascript",
          "swagger-ui-standalone-preset.js": "text/javascript", "favicon-32x32.png": "image/png",
          "favicon-16x16.png": "image/png"}

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>{title} - Swagger UI</title>
  <link rel="stylesheet" href="/docs/swagger-ui.css">
  <link rel="icon" type="image/png" href="/docs/favicon-32x32.png" sizes="32x32">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="/docs/swagger-ui-bundle.js"></script>
  <script src="/docs/swagger-ui-standalone-preset.js"></script>
  <script>
    window.ui = SwaggerUIBundle({{
      url: "/api-doc/openapi.json", dom_id: "#swagger-ui", deepLinking: true,
      presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset], layout: "StandaloneLayout"
    }});
  </script>
</body>
</html>
"""


@functools.cache
def _base_document() -> str:
    return OPENAPI_PATH.read_text(encoding="utf-8")


def openapi_document(settings: ServerSettings) -> dict:
    """Our OpenAPI document, its `info.version` this server's."""
    document = json.loads(_base_document())
    document["info"]["version"] = settings.version
    return document


def _asset_dir() -> Path:
    import swagger_ui_bundle

    return Path(swagger_ui_bundle.swagger_ui_path)


class ApiDocs:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.document = openapi_document(settings)

    async def openapi(self, request: Request) -> Response:
        return JSONBytesResponse(self.document)

    async def page(self, request: Request) -> Response:
        return HTMLResponse(_PAGE.format(title=self.document["info"]["title"]))

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            return Response(status_code=404)
        return FileResponse(_asset_dir() / name, media_type=ASSETS[name])

    def routes(self) -> list[Route]:
        return [Route("/api-doc/openapi.json", self.openapi, methods=["GET"]),
                Route("/docs", self.page, methods=["GET"]),
                Route("/docs/", self.page, methods=["GET"]),
                Route("/docs/{name}", self.asset, methods=["GET"])]
