"""The strategy server's bearer-token check, shared by the JSON API (app.py) and the mounted dashboards.

With a token, every request needs ``Authorization: Bearer <token>`` or the cookie that ``/ui/login`` sets.
Comparisons are constant-time (``secrets.compare_digest``).
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi.responses import JSONResponse

COOKIE = "atorch_token"
UNAUTHORIZED = "missing or wrong bearer token"


def same_token(given: str, token: str) -> bool:
    return secrets.compare_digest(given.encode(), token.encode())


def token_ok(token: str, authorization: str, cookie: str | None) -> bool:
    """Whether an ``Authorization`` header or the login cookie carries ``token``."""
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() == "bearer" and same_token(given.strip(), token):
        return True
    return cookie is not None and same_token(cookie, token)


def cookie_value(header: str) -> str | None:
    """The login cookie's value in a ``Cookie`` header."""
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return None


class TokenGate:
    """ASGI wrapper for mounted apps (the dashboards): the same token check as the API's."""

    def __init__(self, app: Any, token: str | None) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.token is not None:
            headers = dict(scope.get("headers") or [])
            if not token_ok(self.token, headers.get(b"authorization", b"").decode("latin-1"),
                            cookie_value(headers.get(b"cookie", b"").decode("latin-1"))):
                return await JSONResponse({"detail": UNAUTHORIZED}, 401)(scope, receive, send)
        await self.app(scope, receive, send)
