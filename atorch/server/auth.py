"""The strategy server's token check, shared by the JSON API (app.py) and the mounted dashboards.

With a token, every request needs ``Authorization: Bearer <token>`` or the cookie that the sign-in form at
``/ui/login`` sets. The cookie holds an HMAC of the token, never the token itself (a leaked cookie does not
give the API's bearer token). Comparisons are constant-time (``secrets.compare_digest``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from fastapi.responses import JSONResponse

COOKIE = "atorch_session"
UNAUTHORIZED = "missing or wrong bearer token"
LOGIN_FORM = """<!doctype html><html><head><meta charset='utf-8'><title>atorch strategy server</title></head>
<body><h1>atorch strategy server</h1><!--error--><form method="post" action="/ui/login">
<label>Token <input type="password" name="token" autocomplete="current-password" autofocus></label>
<button type="submit">Sign in</button></form></body></html>"""


def same_token(given: str, token: str) -> bool:
    return secrets.compare_digest(given.encode(), token.encode())


def cookie_of(token: str) -> str:
    """The sign-in cookie's value: derived from the token (stable across restarts), not the token."""
    return hmac.new(token.encode(), b"atorch dashboard session", hashlib.sha256).hexdigest()


def credentials_ok(token: str, bearer: str | None, cookie: str | None) -> bool:
    """Whether a bearer credential or the sign-in cookie carries ``token``."""
    if bearer is not None and same_token(bearer, token):
        return True
    return cookie is not None and same_token(cookie, cookie_of(token))


def _bearer(authorization: str) -> str | None:
    scheme, _, given = authorization.partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


def _cookie(header: str) -> str | None:
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return None


class TokenGate:
    """ASGI wrapper for mounted apps (the dashboards): the same check as the API's."""

    def __init__(self, app: Any, token: str | None) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.token is not None:
            headers = dict(scope.get("headers") or [])
            if not credentials_ok(self.token, _bearer(headers.get(b"authorization", b"").decode("latin-1")),
                                  _cookie(headers.get(b"cookie", b"").decode("latin-1"))):
                return await JSONResponse({"detail": UNAUTHORIZED}, 401)(scope, receive, send)
        await self.app(scope, receive, send)
