"""The FastAPI app: /healthz, the /v1 JSON API, the dashboard; bearer-token auth and a request-size limit.

Every /v1 route and the dashboards need ``Authorization: Bearer <token>`` when the server has a token
(a browser may instead open ``/ui/login?token=...`` once, which sets a cookie). A missing or wrong token
is a 401 whose body says only that. Bodies over ``max_body`` bytes are refused with 413 before they are
read in full.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse

from atorch.server import models
from atorch.server.auth import COOKIE, UNAUTHORIZED, same_token, token_ok
from atorch.server.store import LeaseExpired, Studies, StudyBusy, UnknownCandidate, UnknownStudy, UnknownTrial

API_VERSION = "v1"
DEFAULT_MAX_BODY = 8 * 2**20
StudyKey = Path(pattern=models.STUDY_KEY, description="the study key (same as the local search's)")


class BodyLimit:
    """ASGI middleware: 413 for a body over ``limit`` bytes (by Content-Length, or counted as it streams)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _too_large(scope, self.limit, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await _too_large(scope, self.limit, send)


class _TooLarge(Exception):
    pass


async def _too_large(scope: dict, limit: int, send: Any) -> None:
    await JSONResponse({"detail": f"request body over the limit of {limit} bytes"}, 413)(scope, None, send)


def create_app(storage: str, token: str | None = None, max_body: int = DEFAULT_MAX_BODY,
               dashboard: bool = True) -> Any:
    studies = Studies(storage)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        yield
        studies.close()  # the copy for the dashboards is brought up to date, the log closed

    app = FastAPI(title="atorch strategy server", version=API_VERSION, lifespan=lifespan,
                  description="The planner's ask/tell over an Optuna storage (JSON only).")
    app.state.studies = studies

    def auth(request: Request) -> None:
        if token is not None and not token_ok(
            token, request.headers.get("authorization", ""), request.cookies.get(COOKIE)
        ):
            raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(UnknownStudy)
    async def _unknown_study(_: Request, exc: UnknownStudy) -> JSONResponse:
        return JSONResponse({"detail": f"no study {exc.args[0]!r} on this server: create it with PUT first"}, 404)

    @app.exception_handler(UnknownTrial)
    async def _unknown_trial(_: Request, exc: UnknownTrial) -> JSONResponse:
        return JSONResponse({"detail": f"no asked trial number {exc.args[0]} in this study"}, 404)

    @app.exception_handler(UnknownCandidate)
    async def _unknown_candidate(_: Request, exc: UnknownCandidate) -> JSONResponse:
        return JSONResponse({"detail": f"no measured candidate with key {exc.args[0]!r} in this study "
                                       "(confirm re-measures one that a tell measured)"}, 404)

    @app.exception_handler(LeaseExpired)
    async def _expired(_: Request, exc: LeaseExpired) -> JSONResponse:
        return JSONResponse({"detail": f"{exc}: the trial was marked failed; ask again"}, 409)

    @app.exception_handler(StudyBusy)
    async def _busy(_: Request, exc: StudyBusy) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, 409)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:  # on the event loop: also the bench's floor of a request
        return {"status": "ok"}

    v1 = [Depends(auth)]

    @app.put("/v1/studies/{study_key}", response_model=models.StudyInfo, dependencies=v1, tags=["studies"])
    def create_study(body: models.CreateStudy, study_key: str = StudyKey) -> dict[str, Any]:
        """Create-or-get (idempotent): stores the table and config, enqueues the cost model's seeds once."""
        try:
            return studies.create(study_key, body.table.as_json(), body.model_dump(exclude={"table"}))
        except ValueError as exc:
            raise HTTPException(422, f"table: {exc}") from exc

    @app.get("/v1/studies", dependencies=v1, tags=["studies"])
    def list_studies() -> list[str]:
        return studies.names()

    @app.get("/v1/studies/{study_key}", response_model=models.StudyInfo, dependencies=v1, tags=["studies"])
    def get_study(study_key: str = StudyKey,
                  memory_budget: float | None = Query(None, gt=0)) -> dict[str, Any]:
        return studies.info(study_key, memory_budget)

    @app.delete("/v1/studies/{study_key}", status_code=204, dependencies=v1, tags=["studies"])
    def delete_study(study_key: str = StudyKey) -> None:
        studies.delete(study_key)

    @app.post("/v1/studies/{study_key}/ask", response_model=models.AskResponse, dependencies=v1, tags=["search"])
    async def ask(body: models.AskRequest, study_key: str = StudyKey) -> dict[str, Any]:
        """The next candidate to measure (a trial number, its point and a lease), or why to stop."""
        # In memory on the event loop (no thread hop); answered once its row is committed.
        answer, recorded = studies.ask(study_key, body.lease_s)
        await asyncio.wrap_future(recorded)
        return answer

    @app.post("/v1/studies/{study_key}/trials/{number}/tell", response_model=models.TellResponse,
              dependencies=v1, tags=["search"])
    async def tell(body: models.TellRequest, study_key: str = StudyKey,
                   number: int = Path(ge=0, le=2**31 - 1)) -> dict[str, Any]:
        """A measured result or failure; telling a finished trial again changes nothing."""
        answer, recorded = studies.tell(study_key, number, body.measured.to_json())
        await asyncio.wrap_future(recorded)
        return answer

    @app.get("/v1/studies/{study_key}/contenders", response_model=models.Contenders, dependencies=v1,
             tags=["search"])
    def contenders(study_key: str = StudyKey, within: float = Query(ge=0, lt=1)) -> dict[str, Any]:
        """The candidates a confirmation re-measures: the best and a runner-up within ``within`` of it."""
        return studies.contenders(study_key, within)

    @app.post("/v1/studies/{study_key}/confirm", response_model=models.ConfirmResponse, dependencies=v1,
              tags=["search"])
    async def confirm(body: models.ConfirmRequest, study_key: str = StudyKey) -> dict[str, Any]:
        """A second measurement of a measured candidate: its faster run counts, and the best is chosen again."""
        answer, recorded = studies.confirm(study_key, body.key, body.measured.to_json())
        await asyncio.wrap_future(recorded)
        return answer

    @app.get("/v1/studies/{study_key}/best", response_model=models.Best, dependencies=v1, tags=["search"])
    def best(study_key: str = StudyKey, memory_budget: float | None = Query(None, gt=0)) -> dict[str, Any]:
        """The stored best strategy, if it fits ``memory_budget`` (default: the study's)."""
        return {"best": studies.best(study_key, memory_budget)}

    @app.put("/v1/studies/{study_key}/best", response_model=models.Best, dependencies=v1, tags=["search"])
    def store_best(body: models.StoreBest, study_key: str = StudyKey) -> dict[str, Any]:
        """Store the best measured feasible trial as the study's answer (what later jobs get)."""
        return {"best": studies.store_best(study_key, {"strategy": body.strategy} if body.strategy else None)}

    @app.get("/v1/studies/{study_key}/trials", response_model=list[models.Trial], dependencies=v1, tags=["search"])
    def trials(study_key: str = StudyKey) -> list[dict[str, Any]]:
        return studies.trials(study_key)

    if dashboard:
        from atorch.server.dashboard import mount

        @app.get("/ui/login", include_in_schema=False)
        def login(token_: str = Query(alias="token")) -> Any:
            if token is not None and not same_token(token_, token):
                raise HTTPException(401, UNAUTHORIZED)
            response = RedirectResponse("/ui/", status_code=303)
            response.set_cookie(COOKIE, token_, httponly=True, samesite="strict")
            return response

        mount(app, studies, token)  # after the routes above: its mounts take the paths they leave

    return BodyLimit(app, max_body)
