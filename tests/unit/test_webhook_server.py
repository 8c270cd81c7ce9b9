"""The admission webhook's HTTP server refuses what is not an AdmissionReview with a 400."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from omni_operator.webhook import CheckedWebhookServer, review_problem, webhook_document

REVIEW = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
    "uid": "u1", "kind": {"group": "omnistage.io", "version": "v1alpha1", "kind": "OmniPipeline"},
    "resource": {"group": "omnistage.io", "version": "v1alpha1", "resource": "omnipipelines"},
    "operation": "CREATE", "userInfo": {"username": "me"}, "object": {}}}


async def test_a_body_that_is_no_admission_review_is_400_not_500() -> None:
    """Regression (fuzzing): kopf's server read any body as a review, so invalid UTF-8, a JSON
    array or a review without `request` was a 500."""
    seen: list[dict[str, Any]] = []

    async def fn(data: dict[str, Any], **_: Any) -> dict[str, Any]:
        seen.append(data)
        return {"response": {"uid": data["request"]["uid"], "allowed": True}}

    async def handler(request: web.Request) -> web.Response:
        return await CheckedWebhookServer._serve(fn, request)

    app = web.Application()
    app.router.add_post("/{id:.*}", handler)
    async with TestClient(TestServer(app)) as client:
        for raw, words in [(b"{}\xff", "invalid JSON"), (b"[]", "must be an object"),
                           (b"{", "invalid JSON"),
                           (json.dumps({**REVIEW, "request": None}).encode(), "request"),
                           (json.dumps({**REVIEW, "request": {**REVIEW["request"],
                                                               "dryRun": {}}}).encode(),
                            "request.dryRun")]:
            resp = await client.post("/omnipipelines", data=raw)
            assert resp.status == 400, (raw, await resp.text())
            assert words in await resp.text(), raw
        assert seen == []
        resp = await client.post("/omnipipelines", json=REVIEW)
        assert resp.status == 200 and (await resp.json())["response"]["allowed"] is True
        assert seen == [REVIEW]


def test_the_document_is_the_model_the_server_checks() -> None:
    doc = webhook_document()
    review = doc["components"]["schemas"]["AdmissionReview"]
    assert review["required"] == ["apiVersion", "kind", "request"]
    assert set(doc["paths"]) == {"/omnipipelines", "/stagepools"}
    assert review_problem(json.dumps(REVIEW).encode()) is None
