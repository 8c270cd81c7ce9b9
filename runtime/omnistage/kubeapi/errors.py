"""The client's errors: what a caller catches, with the API server's Status kept.

Why a module of its own: the credentials, the client and its callers all raise or read these,
and none of them should need the others to do so.
"""

from __future__ import annotations

from typing import Any


class ConfigError(RuntimeError):
    """No usable credentials, or a kubeconfig this client cannot use (says which field)."""


class ApiError(RuntimeError):
    """A non-2xx answer from the API server; the Status body is kept for callers and tests."""

    def __init__(self, status: int, body: Any, method: str, path: str) -> None:
        self.status = status
        self.body = body
        self.method, self.path = method, path
        self.reason = str(body.get("reason", "")) if isinstance(body, dict) else ""
        self.message = (
            str(body.get("message", body)) if isinstance(body, dict) else str(body)[:500]
        )
        super().__init__(f"{method} {path}: HTTP {status} {self.reason}: {self.message}")



def namespace_terminating(exc: BaseException) -> bool:
    """The API server refused a write because the namespace is being deleted: told by the
    Status's cause (NamespaceLifecycle admission; a StatusCause's type travels as `reason`),
    not by the message's English."""
    if not isinstance(exc, ApiError) or exc.status != 403 or not isinstance(exc.body, dict):
        return False
    details = exc.body.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    return any(isinstance(c, dict) and c.get("reason") == "NamespaceTerminating"
               for c in causes or [])


class WatchExpired(ApiError):
    """410 Gone: the watch's resourceVersion is older than the server keeps; list again."""

