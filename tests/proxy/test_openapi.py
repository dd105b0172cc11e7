"""The OpenAPI document: valid OpenAPI 3.1, served, and naming exactly the routes the app has.
(Real requests and answers are checked against it in tests/e2e/test_openapi.py.)"""

from __future__ import annotations

import dataclasses
import re

import httpx
import pytest
from openapi_spec_validator import validate
from starlette.routing import Route

from proxy.app import create_app
from proxy.openapi import document
from proxy.options import ProxyOptions

pytestmark = pytest.mark.anyio


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = document()
    assert doc["openapi"].startswith("3.1")
    validate(doc)


def test_every_route_is_documented_and_nothing_else(options: ProxyOptions) -> None:
    app = create_app(options)
    # A path parameter's converter ({model:path}) is Starlette's, not part of the path.
    routes = {(method.lower(), re.sub(r":\w+}", "}", route.path)) for route in app.routes
              if isinstance(route, Route) for method in route.methods or () if method != "HEAD"}
    documented = {(method, path) for path, ops in document()["paths"].items() for method in ops}
    assert routes == documented


def test_request_bodies_are_the_schemas_the_handlers_decode_with() -> None:
    schemas = document()["components"]["schemas"]
    completion = schemas["CompletionRequest"]
    assert completion["required"] == ["prompt"]
    assert completion["properties"]["n"]["maximum"] == 128  # proxy.openai.schemas.MAX_N
    assert schemas["CreateResponse"]["required"] == ["input"]


async def test_the_document_is_served_without_a_key(options: ProxyOptions) -> None:
    options = dataclasses.replace(options, api_keys=("secret",))
    app = create_app(options)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        r = await c.get("/openapi.json")
    assert r.status_code == 200 and r.json() == document()
