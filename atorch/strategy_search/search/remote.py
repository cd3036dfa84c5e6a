"""The strategy server's client (httpx) and RemotePlanner: the planner's search loop over a study on a server.

RemotePlanner runs ``Planner.search`` (the same loop as a local search: stop rules, dry-runs on this side through
the ``measure`` callback, the confirmation of a close runner-up) over ``RemoteStudy``: the server keeps the study,
decides what to run next, records confirmations, and answers a later job with the same key from its stored best,
with no dry-run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from atorch.errors import SetupError
from atorch.log import get_logger
from atorch.settings import settings
from atorch.strategy_search.search.ask_tell import Proposal
from atorch.strategy_search.search.candidates import CandidateTable
from atorch.strategy_search.search.outcome import Measured
from atorch.strategy_search.search.planner import Planner, PlanResult, SearchStudy
from atorch.strategy_search.search.retry import LOG_EVERY_S, RETRIED_STATUS, RETRY_ENV, Backoff, retry_after, transient
from atorch.strategy_search.search.space import SearchSpace

logger = get_logger(__name__)
SERVER_ENV, TOKEN_ENV = "ATORCH_STRATEGY_SERVER", "ATORCH_SERVER_TOKEN"


class ServerError(SetupError):
    """The server answered with an error status (``status_code``)."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class StrategyClient:
    """The /v1 API. Every failure is a SetupError naming the URL and the fix.

    A server that is restarting or briefly failing (refused or dropped connections, time-outs, 429/502/503/504)
    is retried with growing waits for up to ``retry_s`` seconds (default $ATORCH_SERVER_RETRY_S, else 120 s;
    0: no retry); see ``atorch.strategy_search.search.retry``."""

    def __init__(self, server_url: str, token: str | None = None, timeout_s: float = 30.0,
                 retry_s: float | None = None) -> None:
        import httpx

        self.url = server_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry_s = settings().server_retry_s if retry_s is None else retry_s
        if not (self.retry_s >= 0 and math.isfinite(self.retry_s)):
            raise SetupError(f"retry_s must be a finite number of seconds >= 0, got {self.retry_s!r}")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)
        self._logged_at = -math.inf  # when this client last logged a retry (they are logged once in a while)

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, body: Any = None, params: dict | None = None) -> Any:
        response, retried = self._send(method, path, body, params)
        if retried and method == "DELETE" and response.status_code == 404:
            return None  # a retried deletion whose first attempt was committed before its answer was lost: done
        if response.status_code == 401:
            raise SetupError(f"strategy server {self.url} refused the token (401): set ${TOKEN_ENV} to the "
                             "token the server was started with (atorch serve --token)")
        if response.status_code >= 400:
            raise ServerError(f"strategy server {self.url} answered {response.status_code} to {method} {path}: "
                              f"{_detail(response)}; check that server and client run the same atorch version",
                              response.status_code)
        return response.json() if response.content else None

    def _send(self, method: str, path: str, body: Any, params: dict | None) -> tuple[Any, bool]:
        """The server's answer, retried through restarts and overloads (``atorch.strategy_search.search.retry``) until
        ``retry_s`` after the first failure; and whether it took a retry."""
        import httpx

        backoff: Backoff | None = None
        while True:
            hint = None
            # A retry never runs past the deadline: its time-out is what is left of it (1 s at least).
            timeout = self.timeout_s if backoff is None else min(self.timeout_s, max(1.0, backoff.remaining()))
            try:
                response = self.http.request(method, path, json=body, params=params, timeout=timeout)
            except httpx.HTTPError as exc:
                if not transient(exc):
                    raise SetupError(f"strategy server {self.url} is unreachable ({type(exc).__name__}: {exc}); "
                                     f"fix the URL (strategy_server= / ${SERVER_ENV})") from exc
                failure, cause = f"{type(exc).__name__}: {exc}", exc
            else:
                if response.status_code not in RETRIED_STATUS:
                    if backoff is not None and self._logged_at >= backoff.start:
                        logger.info("strategy server %s answers again (%s %s after %.1f s, %d attempts)",
                                    self.url, method, path, backoff.elapsed(), backoff.attempts)
                    return response, backoff is not None
                failure, cause = f"{response.status_code} {_detail(response)}", None
                hint = retry_after(response)
            backoff = backoff or Backoff(self.retry_s)
            self._log_retry(backoff, method, path, failure, cause is not None)
            if not backoff.wait(hint):
                raise SetupError(self._gave_up(backoff, method, path, failure, cause is not None)) from cause

    def _log_retry(self, backoff: Backoff, method: str, path: str, failure: str, unreachable: bool) -> None:
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S or backoff.deadline_s <= 0:
            return
        self._logged_at = now
        state = "unreachable" if unreachable else "unavailable"
        logger.warning("strategy server %s %s (%s %s: %s), retrying for up to %.0f s (%.0f s so far; $%s "
                       "lengthens it)", self.url, state, method, path, failure, backoff.deadline_s,
                       backoff.elapsed(), RETRY_ENV)

    def _gave_up(self, backoff: Backoff, method: str, path: str, failure: str, unreachable: bool) -> str:
        state = "is unreachable" if unreachable else "kept failing"
        fix = (f"start it with `atorch serve --host 127.0.0.1 --port 8765` or fix the URL (strategy_server= / "
               f"${SERVER_ENV})" if unreachable else "check the server's log (or its proxy's)")
        return (f"strategy server {self.url} {state}: {method} {path} failed {backoff.attempts} time(s) over "
                f"{backoff.elapsed():.1f} s (last error: {failure}); {fix}; to wait longer for a server that is "
                f"restarting, set ${RETRY_ENV} (now {backoff.deadline_s:g} s) or pass retry_s=")

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz")

    def create_study(self, key: str, table: dict[str, Any], memory_budget: float, **config: Any) -> dict[str, Any]:
        return self._call("PUT", f"/v1/studies/{key}", {"table": table, "memory_budget": memory_budget, **config})

    def study(self, key: str, memory_budget: float | None = None) -> dict[str, Any]:
        return self._call("GET", f"/v1/studies/{key}",
                          params={"memory_budget": memory_budget} if memory_budget else None)

    def ask(self, key: str, lease_s: float | None = None, memory_budget: float | None = None) -> dict[str, Any]:
        return self._call("POST", f"/v1/studies/{key}/ask", {"lease_s": lease_s, "memory_budget": memory_budget})

    def tell(self, key: str, number: int, measured: dict[str, Any],
             memory_budget: float | None = None) -> dict[str, Any]:
        return self._call("POST", f"/v1/studies/{key}/trials/{number}/tell",
                          {"measured": measured, "memory_budget": memory_budget})

    def contenders(self, key: str, within: float, memory_budget: float | None = None) -> dict[str, Any]:
        params = {"within": within, **({"memory_budget": memory_budget} if memory_budget else {})}
        return self._call("GET", f"/v1/studies/{key}/contenders", params=params)

    def confirm(self, key: str, candidate: str, measured: dict[str, Any],
                memory_budget: float | None = None) -> dict[str, Any]:
        return self._call("POST", f"/v1/studies/{key}/confirm",
                          {"key": candidate, "measured": measured, "memory_budget": memory_budget})

    def best(self, key: str, memory_budget: float | None = None) -> dict[str, Any] | None:
        params = {"memory_budget": memory_budget} if memory_budget else None
        return self._call("GET", f"/v1/studies/{key}/best", params=params)["best"]

    def store_best(self, key: str, strategy: dict[str, Any] | None,
                   memory_budget: float | None = None) -> dict[str, Any] | None:
        return self._call("PUT", f"/v1/studies/{key}/best",
                          {"strategy": strategy, "memory_budget": memory_budget})["best"]

    def trials(self, key: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/v1/studies/{key}/trials")

    def delete(self, key: str) -> None:
        self._call("DELETE", f"/v1/studies/{key}")


def _detail(response: Any) -> str:
    """An error answer's ``detail`` (FastAPI's), else the start of its body."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail) if detail is not None else response.text[:500]


def _record(trial: dict[str, Any]) -> dict[str, Any]:
    """A listed trial in the shape of Planner's trial records."""
    return {"number": trial["number"], "value": trial["value"], "constraints": trial["constraints"],
            **trial["user_attrs"]}


class RemotePlanner(Planner):
    """Planner whose study lives on a strategy server: same arguments (``storage`` is unused: the server's
    storage holds the study), plus ``server_url`` (default $ATORCH_STRATEGY_SERVER) and ``token`` (default
    $ATORCH_SERVER_TOKEN). ``lease_s``: how long the server waits for a result before marking a trial failed;
    ``retry_s``: how long a request is retried while the server is unreachable or restarting (StrategyClient)."""

    def __init__(
        self,
        space: SearchSpace,
        *,
        server_url: str | None = None,
        token: str | None = None,
        lease_s: float = 600.0,
        timeout_s: float = 30.0,
        retry_s: float | None = None,
        **planner_args: Any,
    ) -> None:
        if not isinstance(planner_args.get("sampler", "tpe"), str):
            raise SetupError("a strategy server runs its own sampler: pass sampler='tpe' or 'gp', not an object")
        if planner_args.get("storage") is None:
            planner_args["storage"] = "server"
        super().__init__(space, **planner_args)
        url = server_url or settings().strategy_server
        if not url:
            raise SetupError(f"no strategy server given: pass server_url= or set ${SERVER_ENV}")
        self.server_url = url
        self.lease_s = lease_s
        self.server_study: str | None = None  # the study's name on the server (``_create``)
        self.client = StrategyClient(url, token if token is not None else settings().server_token, timeout_s,
                                     retry_s)

    def _create(self) -> dict[str, Any]:
        """Create-or-get the study; the server names it (the key plus a digest of the table: a job with another
        space or hardware gets another study), and every later call uses that name, with this job's budget."""
        info = self.client.create_study(
            self.study_name, self.table().to_json(), self.memory_budget, sampler=self.sampler,
            max_trials=self.max_trials, top_k=self.top_k, seed=self.seed, lease_s=self.lease_s,
            stop_when_nothing_left=self.stop_when_nothing_left)
        self.server_study = info["study_key"]
        return info

    def server_name(self) -> str:
        """The study's name on the server (created on first use)."""
        if self.server_study is None:
            self._create()
        return self.server_study  # type: ignore[return-value]

    def study(self) -> Any:
        raise SetupError(f"the study {self.study_name} lives on {self.server_url}: use trials() or the server's API")

    def trials(self) -> list[dict[str, Any]]:
        return [_record(t) for t in self.client.trials(self.server_name())]

    def cached(self) -> PlanResult | None:
        return self.search_study().start(force=False)

    def search_study(self) -> RemoteStudy:
        return RemoteStudy(self)


class RemoteStudy(SearchStudy):
    """The study on a strategy server, as ``Planner.search`` drives it: ask, tell and confirm over HTTP (the
    server runs ``SearchState`` on its side). Trials told on the server's side (known candidates, predicted OOMs)
    reach ``on_trial`` as an ask lists them."""

    def __init__(self, planner: RemotePlanner) -> None:
        self.planner, self.client, self.key = planner, planner.client, planner.study_name

    def start(self, force: bool) -> PlanResult | None:
        p = self.planner
        info = p._create()
        self.key = info["study_key"]
        if force or info["cached"] is None:
            return None
        best = info["cached"]
        logger.info("strategy search: cached best on %s (%.3g samples/s)", p.server_url, best["samples_per_s"])
        return PlanResult(p.space.from_point(best["point"]), best["samples_per_s"], "cache", p.study_name,
                          stop_reason="cached", trials=p.trials())

    def ask(self, stop: Callable[[], str]) -> Proposal:
        if reason := stop():
            return Proposal(None, stop=reason)
        answer = self.client.ask(self.key, self.planner.lease_s, self.planner.memory_budget)
        for record in answer["told"]:
            self._seen(record)
        if answer["number"] is None:
            return Proposal(None, stop=answer["stop"])
        return Proposal(answer["number"], answer["point"], answer["key"], answer["predicted"])

    def tell(self, number: int, measured: Measured) -> dict[str, Any] | None:
        try:
            told = self.client.tell(self.key, number, measured.to_json(), self.planner.memory_budget)
        except ServerError as exc:
            if exc.status_code != 409:
                raise
            # The dry-run outlived its lease: the server marked the trial failed; the search goes on.
            logger.warning("trial %d: %s (raise lease_s above the longest dry-run)", number, exc)
            return None
        improved = told["improved"]
        if told["already_told"]:
            # This job tells each trial once: the first tell was stored and its answer lost (the server went down
            # as it answered), and the retry cannot say whether it improved the best; the study can.
            improved = self._is_best(told["record"])
        self._seen(told["record"])
        return {**told["record"], "improved": improved}

    def _is_best(self, record: dict[str, Any]) -> bool:
        # The best two ok candidates, whatever their gap (the route lists a runner-up within a fraction < 1).
        found, measured_ok = self.contenders(1 - 1e-9)
        if record.get("status") != "ok":
            return False
        return found[0]["key"] == record.get("key") if found else measured_ok == 1

    def contenders(self, within: float) -> tuple[list[dict[str, Any]], int]:
        answer = self.client.contenders(self.key, within, self.planner.memory_budget)
        return answer["contenders"], answer["measured_ok"]

    def confirm(self, key: str, measured: Measured) -> tuple[dict[str, Any], dict[str, Any] | None]:
        answer = self.client.confirm(self.key, key, measured.to_json(), self.planner.memory_budget)
        return answer["record"], answer["best"]

    def finish(self, kind: str, stop: str, strategy_of: Callable[[Any], dict[str, Any]]
               ) -> tuple[dict[str, Any] | None, str]:
        budget = self.planner.memory_budget
        stored = self.client.store_best(self.key, None, budget)  # the best measured, chosen on the server
        if stored is not None:
            stored = self.client.store_best(self.key, strategy_of(stored["point"]), budget)
        return stored, f"study {self.key} on {self.planner.server_url}"

    def abort(self, kind: str, reason: str) -> None:
        """Nothing to store: the server keeps every told trial, and a later search asks it again."""

    def trials(self) -> list[dict[str, Any]]:
        return self.planner.trials()

    def _seen(self, record: dict[str, Any]) -> None:
        if self.planner.on_trial is not None:
            self.planner.on_trial(record)


__all__ = ["CandidateTable", "RemotePlanner", "RemoteStudy", "ServerError", "StrategyClient"]
