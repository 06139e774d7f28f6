"""`/docs` works offline: Swagger UI's files are served by the API itself, never a CDN."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from cortex_api.app import create_app
from cortex_worker.settings import Settings

pytestmark = pytest.mark.unit

CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png",
                 ".json": "application/json"}


def test_the_docs_page_references_only_files_the_api_serves() -> None:
    client = TestClient(create_app(Settings()))  # no lifespan: the page needs no Redis
    page = client.get("/docs")
    assert page.status_code == 200
    html = page.text
    urls = re.findall(r"""(?:src|href)="([^"]+)"|url: '([^']+)'""", html)
    urls = [a or b for a, b in urls]
    assert sorted(urls) == ["/docs/assets/favicon-32x32.png", "/docs/assets/swagger-ui-bundle.js",
                            "/docs/assets/swagger-ui.css", "/openapi.json"]
    assert "://" not in html and "//cdn" not in html
    assert '"validatorUrl": null' in html  # Swagger UI would fetch a badge from the internet
    for url in urls:
        response = client.get(url)
        assert response.status_code == 200, url
        assert response.headers["content-type"].startswith(CONTENT_TYPES[url[url.rindex("."):]])
        assert len(response.content) > 500, url
    assert b"SwaggerUIBundle" in client.get("/docs/assets/swagger-ui-bundle.js").content
    assert client.get("/openapi.json").json()["info"]["title"] == "Cortex"
