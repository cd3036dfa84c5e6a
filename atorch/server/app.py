"""The FastAPI app: /healthz, the /v1 JSON API, the dashboard; bearer-token auth and a request-size limit.

Every /v1 route and the dashboards need ``Authorization: Bearer <token>`` when the server has a token (a
browser signs in once on the form at ``/ui/login``, which POSTs the token and sets a cookie holding a value
derived from it). A missing or wrong token is a 401 whose body says only that. Bodies over ``max_body`` bytes
are refused with 413, whether announced by Content-Length or streamed in chunks.

The /v1 routes are plain ``def``: FastAPI runs them in its worker threads, so sampling and the storage's
commits never hold the event loop (``/healthz`` answers while they run). A storage failure or a busy study
is a 503 with ``Retry-After``: nothing was acknowledged, and the client retries.
"""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qs

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.security import APIKeyCookie, HTTPAuthorizationCredentials, HTTPBearer

from atorch.server import models
from atorch.server.auth import (
    COOKIE,
    LOGIN_FORM,
    SESSION_S,
    UNAUTHORIZED,
    FailedTokens,
    client_address,
    cookie_of,
    cookie_ok,
    same_token,
)
from atorch.server.health import StorageHealth
from atorch.server.sqlite_lock import sqlite_path
from atorch.server.store import (
    LeaseExpired,
    Studies,
    StudyBusy,
    Unavailable,
    UnknownCandidate,
    UnknownStudy,
    UnknownTrial,
)

API_VERSION = "v1"
DEFAULT_MAX_BODY = 8 * 2**20
RETRY_AFTER_S = 1
StudyKey = Path(pattern=models.STUDY_KEY, description="the study's name (PUT answers it as ``study_key``)")
NewKey = Path(pattern=models.STUDY_KEY, max_length=models.MAX_KEY, description=(
    f"the study's key (at most {models.MAX_KEY} characters: its name adds a digest of the space)"))
# OpenAPI links (what a client, or schemathesis's stateful phase, calls next with a value from an answer): the
# routes that take the name a PUT answers, and the tell of the trial an ask answers.
_BY_NAME = {"study_key": "$response.body#/study_key"}
STUDY_LINKS = {op: {"operationId": op, "parameters": _BY_NAME}
               for op in ("ask", "get_study", "trials", "best", "store_best", "contenders", "delete_study")}
ASK_LINKS = {"tell": {"operationId": "tell", "parameters": {"study_key": "$request.path.study_key",
                                                            "number": "$response.body#/number"}}}


class BodyLimit:
    """ASGI middleware: 413 for a body over ``limit`` bytes (by Content-Length, or counted as it streams: the
    body is read here before the app sees it, so a chunked one is refused whole, never half-parsed)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _too_large(scope, self.limit, send)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                return await self.app(scope, _replay([message], receive), send)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await _too_large(scope, self.limit, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)


def _replay(first: list[dict], receive: Any) -> Any:
    async def replayed() -> dict:
        return first.pop(0) if first else await receive()

    return replayed


async def _too_large(scope: dict, limit: int, send: Any) -> None:
    await JSONResponse({"detail": f"request body over the limit of {limit} bytes"}, 413)(scope, None, send)


def _encodable(value: Any) -> Any:
    """A validation error's echo as strict JSON (a non-finite number becomes its text)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _encodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    return value


def create_app(storage: str, token: str | None = None, max_body: int = DEFAULT_MAX_BODY,
               dashboard: bool = True, ask_cap_s: float = 1.0, busy_timeout_s: float = 5.0,
               address: str | None = None, failures: FailedTokens | None = None,
               health_every_s: float = 2.0) -> Any:
    """The app over ``storage``. On a SQLite file this takes the one-server lock first (``SetupError`` naming the
    server that holds it); ``address`` is what the lock file says of this one."""
    studies = Studies(storage, ask_cap_s=ask_cap_s, busy_timeout_s=busy_timeout_s, address=address)
    health = StorageHealth(studies.rdb.engine, sqlite_path(storage), studies.heal_pool, every_s=health_every_s)
    studies.on_storage_error = health.invalidate
    failures = failures or FailedTokens()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        yield
        health.close()
        studies.close()

    app = FastAPI(title="atorch strategy server", version=API_VERSION, lifespan=lifespan,
                  description="The planner's ask/tell over an Optuna storage (JSON only).")
    app.state.studies = studies
    bearer = HTTPBearer(auto_error=False, description="the server's token (atorch serve --token)")
    cookie = APIKeyCookie(name=COOKIE, auto_error=False, description="set by the sign-in form at /ui/login")

    def auth(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer),
             session: str | None = Depends(cookie)) -> None:
        if token is None or (session is not None and cookie_ok(token, session)):
            return
        given = credentials.credentials if credentials is not None else None
        address = client_address(request.scope)
        if given is not None and (wait := failures.retry_after(address)):  # right or wrong: not tried
            raise HTTPException(429, f"too many wrong tokens from {address}: retry after {wait} s",
                                headers={"Retry-After": str(wait)})
        if given is None or not same_token(given, token):
            if given is not None:
                failures.failed(address)
            raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})

    def error(status: int, detail: str, retry: bool = False) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else None
        return JSONResponse({"detail": detail}, status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _encodable(jsonable_encoder(exc.errors()))}, 422)

    @app.exception_handler(UnknownStudy)
    async def _unknown_study(_: Request, exc: UnknownStudy) -> JSONResponse:
        return error(404, f"no study {exc.args[0]!r} on this server: create it with PUT first")

    @app.exception_handler(UnknownTrial)
    async def _unknown_trial(_: Request, exc: UnknownTrial) -> JSONResponse:
        return error(404, f"no asked trial number {exc.args[0]} in this study")

    @app.exception_handler(UnknownCandidate)
    async def _unknown_candidate(_: Request, exc: UnknownCandidate) -> JSONResponse:
        return error(404, f"no measured candidate with key {exc.args[0]!r} in this study "
                          "(confirm re-measures one that a tell measured)")

    @app.exception_handler(LeaseExpired)
    async def _expired(_: Request, exc: LeaseExpired) -> JSONResponse:
        return error(409, f"{exc}: the trial was marked failed; ask again")

    @app.exception_handler(StudyBusy)
    async def _busy(_: Request, exc: StudyBusy) -> JSONResponse:
        return error(409, str(exc))

    @app.exception_handler(Unavailable)
    async def _unavailable(_: Request, exc: Unavailable) -> JSONResponse:
        return error(503, f"{exc}; nothing was stored: retry", retry=True)

    @app.get("/healthz", tags=["health"], responses={503: {"description": "the storage cannot be written"}})
    async def healthz() -> Any:  # on the event loop: also the bench's floor of a request
        """``ok``, or 503 naming why the storage cannot be read and written (probed every few seconds)."""
        problem = await health.problem()
        if problem is not None:
            return JSONResponse({"status": "unavailable", "storage": problem}, 503)
        return {"status": "ok", "storage": "ok"}

    v1 = [Depends(auth)]

    @app.put("/v1/studies/{study_key}", response_model=models.StudyInfo, dependencies=v1, tags=["studies"],
             operation_id="create_study", responses={200: {"links": STUDY_LINKS}})
    def create_study(body: models.CreateStudy, study_key: str = NewKey) -> dict[str, Any]:
        """Create-or-get (idempotent) the study of this key for this table (the space and the hardware's
        predictions): its name, answered as ``study_key``, is the key plus the table's digest; the other routes
        take that name, and each may carry the caller's ``memory_budget`` (default: this one)."""
        try:
            return studies.create(study_key, body.table.as_json(), body.model_dump(exclude={"table"}))
        except ValueError as exc:
            raise HTTPException(422, f"table: {exc}") from exc

    @app.get("/v1/studies", dependencies=v1, tags=["studies"], operation_id="list_studies")
    def list_studies() -> list[str]:
        return studies.names()

    @app.get("/v1/studies/{study_key}", response_model=models.StudyInfo, dependencies=v1, tags=["studies"],
             operation_id="get_study")
    def get_study(study_key: str = StudyKey,
                  memory_budget: float | None = Query(None, gt=0, allow_inf_nan=False)) -> dict[str, Any]:
        return studies.info(study_key, memory_budget)

    @app.delete("/v1/studies/{study_key}", status_code=204, dependencies=v1, tags=["studies"],
                operation_id="delete_study")
    def delete_study(study_key: str = StudyKey) -> None:
        studies.delete(study_key)

    @app.post("/v1/studies/{study_key}/ask", response_model=models.AskResponse, dependencies=v1, tags=["search"],
              operation_id="ask", responses={200: {"links": ASK_LINKS}})
    def ask(body: models.AskRequest, study_key: str = StudyKey) -> dict[str, Any]:
        """The next candidate to measure (a trial number, its point and a lease), or why to stop."""
        return studies.ask(study_key, body.lease_s, body.memory_budget)

    @app.post("/v1/studies/{study_key}/trials/{number}/tell", response_model=models.TellResponse,
              dependencies=v1, tags=["search"], operation_id="tell")
    def tell(body: models.TellRequest, study_key: str = StudyKey,
             number: int = Path(ge=0, le=2**31 - 1)) -> dict[str, Any]:
        """A measured result or failure, answered once committed; telling a finished trial again changes nothing."""
        return studies.tell(study_key, number, body.measured.to_json(), body.memory_budget)

    @app.get("/v1/studies/{study_key}/contenders", response_model=models.Contenders, dependencies=v1,
             tags=["search"], operation_id="contenders")
    def contenders(study_key: str = StudyKey,
                   within: float = Query(ge=0, lt=1, allow_inf_nan=False),
                   memory_budget: float | None = Query(None, gt=0, allow_inf_nan=False)) -> dict[str, Any]:
        """The candidates a confirmation re-measures: the best and a runner-up within ``within`` of it."""
        return studies.contenders(study_key, within, memory_budget)

    @app.post("/v1/studies/{study_key}/confirm", response_model=models.ConfirmResponse, dependencies=v1,
              tags=["search"], operation_id="confirm")
    def confirm(body: models.ConfirmRequest, study_key: str = StudyKey) -> dict[str, Any]:
        """A second measurement of a measured candidate: this run (back to back with its contender's) counts, and
        the best is chosen again."""
        return studies.confirm(study_key, body.key, body.measured.to_json(), body.memory_budget)

    @app.get("/v1/studies/{study_key}/best", response_model=models.Best, dependencies=v1, tags=["search"],
             operation_id="best")
    def best(study_key: str = StudyKey,
             memory_budget: float | None = Query(None, gt=0, allow_inf_nan=False)) -> dict[str, Any]:
        """The stored best strategy, if it fits ``memory_budget`` (default: the study's)."""
        return {"best": studies.best(study_key, memory_budget)}

    @app.put("/v1/studies/{study_key}/best", response_model=models.Best, dependencies=v1, tags=["search"],
             operation_id="store_best")
    def store_best(body: models.StoreBest, study_key: str = StudyKey) -> dict[str, Any]:
        """Store the best measured feasible trial as the study's answer (what later jobs get)."""
        extra = {"strategy": body.strategy} if body.strategy else None
        return {"best": studies.store_best(study_key, extra, body.memory_budget)}

    @app.get("/v1/studies/{study_key}/trials", response_model=list[models.Trial], dependencies=v1, tags=["search"],
             operation_id="trials")
    def trials(study_key: str = StudyKey) -> list[dict[str, Any]]:
        return studies.trials(study_key)

    if dashboard:
        from atorch.server.dashboard import mount

        @app.get("/ui/login", include_in_schema=False, response_class=HTMLResponse)
        def login_form() -> str:
            return LOGIN_FORM

        @app.post("/ui/login", include_in_schema=False)
        async def login(request: Request) -> Any:
            # A form POST (the token stays out of URLs and access logs); parsed here: one field.
            given = (parse_qs((await request.body()).decode("utf-8", "replace")).get("token") or [""])[0]
            address = client_address(request.scope)
            if token is not None and (wait := failures.retry_after(address)):
                return failures.refusal(address, wait)
            if token is not None and not same_token(given, token):
                failures.failed(address)
                return HTMLResponse(LOGIN_FORM.replace("<!--error-->", f"<p>{UNAUTHORIZED}</p>"), 401)
            response = RedirectResponse("/ui/", status_code=303)
            if token is not None:
                response.set_cookie(COOKIE, cookie_of(token), max_age=SESSION_S, httponly=True, samesite="strict",
                                    secure=request.url.scheme == "https")
            return response

        mount(app, studies, token, failures)  # after the routes above: its mounts take the paths they leave

    return BodyLimit(app, max_body)
