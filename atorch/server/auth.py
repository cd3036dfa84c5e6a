"""The strategy server's token check, shared by the JSON API (app.py) and the mounted dashboards.

With a token, every request needs ``Authorization: Bearer <token>`` or the cookie that the sign-in form at
``/ui/login`` sets. The cookie holds its expiry and an HMAC of it keyed by the token, never the token itself (a
leaked cookie does not give the API's bearer token, and stops working when it expires: ``SESSION_S``).
Comparisons are constant-time (``secrets.compare_digest``). Wrong tokens are counted per client address
(``FailedTokens``): after too many, that address's tokens are refused with 429 for a while, right or wrong (a
right one let through would tell a guesser it was right). Cookies are not counted: an HMAC cannot be guessed.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import math
import secrets
import threading
import time
from typing import Any

from fastapi.responses import JSONResponse

COOKIE = "atorch_session"
SESSION_S = 12 * 3600  # a sign-in lasts this long (the cookie's Max-Age, and checked by the server)
UNAUTHORIZED = "missing or wrong bearer token"
LOGIN_FORM = """<!doctype html><html><head><meta charset='utf-8'><title>atorch strategy server</title></head>
<body><h1>atorch strategy server</h1><!--error--><form method="post" action="/ui/login">
<label>Token <input type="password" name="token" autocomplete="current-password" autofocus></label>
<button type="submit">Sign in</button></form></body></html>"""


def same_token(given: str, token: str) -> bool:
    return secrets.compare_digest(given.encode(), token.encode())


def _signature(token: str, expires: int) -> str:
    return hmac.new(token.encode(), f"atorch dashboard session until {expires}".encode(), hashlib.sha256).hexdigest()


def cookie_of(token: str, now: float | None = None) -> str:
    """A new sign-in cookie's value: its expiry (unix time) and an HMAC of it keyed by the token (stable across
    restarts; not the token)."""
    expires = int(time.time() if now is None else now) + SESSION_S
    return f"{expires}.{_signature(token, expires)}"


def cookie_ok(token: str, cookie: str, now: float | None = None) -> bool:
    expires, _, signature = cookie.partition(".")
    if not (expires.isdigit() and len(expires) <= 12):  # a unix time (and int() of a huge one would raise)
        return False
    if not secrets.compare_digest(signature.encode(), _signature(token, int(expires)).encode()):
        return False
    return int(expires) > (time.time() if now is None else now)


class FailedTokens:
    """Wrong tokens per client address in a sliding window: at ``limit`` within ``window_s``, the address's
    tokens are refused (``retry_after`` says for how long) until the oldest failure leaves the window. Right
    tokens are never counted or delayed. At most ``max_addresses`` are tracked (the oldest forgotten first)."""

    def __init__(self, limit: int = 10, window_s: float = 60.0, max_addresses: int = 10_000) -> None:
        self.limit, self.window_s, self.max_addresses = limit, window_s, max_addresses
        self._seen: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def retry_after(self, address: str) -> int | None:
        """Seconds until ``address`` may try a token again; None: now."""
        now = time.monotonic()
        with self._lock:
            times = self._seen.get(address)
            if times is None:
                return None
            while times and times[0] <= now - self.window_s:
                times.popleft()
            if not times:
                del self._seen[address]
                return None
            return max(1, math.ceil(times[0] + self.window_s - now)) if len(times) >= self.limit else None

    def failed(self, address: str) -> None:
        with self._lock:
            times = self._seen.pop(address, None) or collections.deque(maxlen=self.limit)
            times.append(time.monotonic())
            self._seen[address] = times  # most recent last
            while len(self._seen) > self.max_addresses:
                self._seen.popitem(last=False)

    def refusal(self, address: str, wait_s: int) -> JSONResponse:
        return JSONResponse({"detail": f"too many wrong tokens from {address}: retry after {wait_s} s"}, 429,
                            headers={"Retry-After": str(wait_s)})


def client_address(scope: dict) -> str:
    client = scope.get("client")
    return client[0] if client else "unknown"


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

    def __init__(self, app: Any, token: str | None, failures: FailedTokens | None = None) -> None:
        self.app, self.token, self.failures = app, token, failures or FailedTokens()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.token is not None:
            headers = dict(scope.get("headers") or [])
            bearer = _bearer(headers.get(b"authorization", b"").decode("latin-1"))
            cookie = _cookie(headers.get(b"cookie", b"").decode("latin-1"))
            address = client_address(scope)
            if cookie is not None and cookie_ok(self.token, cookie):
                return await self.app(scope, receive, send)
            if bearer is not None and (wait := self.failures.retry_after(address)):
                return await self.failures.refusal(address, wait)(scope, receive, send)
            if bearer is None or not same_token(bearer, self.token):
                if bearer is not None:
                    self.failures.failed(address)
                return await JSONResponse({"detail": UNAUTHORIZED}, 401)(scope, receive, send)
        await self.app(scope, receive, send)
