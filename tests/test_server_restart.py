"""Clients ride out a strategy server that restarts: refused and dropped connections, 429/502/503/504 and lost
answers are retried (with backoff, Retry-After honoured) until ``retry_s``, without counting a tell twice; after
the deadline the error names the URL, the last error and the setting. Real sockets, a real uvicorn (in a thread,
or ``atorch serve`` killed with SIGKILL and started again on the same port and SQLite file), no mocks."""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time

import httpx
import optuna
import pytest
from lossy_proxy import LossyProxy
from server_harness import ProcessServer, ThreadServer, free_port
from test_planner import BUDGET, Measure, landscape_space, predict
from test_server import sqlite
from test_server_failures import grid

from atorch.errors import SetupError
from atorch.strategy_search.search.outcome import Measured
from atorch.strategy_search.search.remote import RemotePlanner, ServerError, StrategyClient
from atorch.strategy_search.search.retry import retry_after

RETRY_LINE = "retrying for up to"


def retry_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if RETRY_LINE in r.getMessage()]


def stored_trials(storage: str, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)


def test_a_refused_connection_is_retried_until_the_server_listens(tmp_path, caplog) -> None:
    """Nothing listens on the port for 1.5 s (connections refused), then a server does: the request started
    before it is answered, and the retries are logged once, not per attempt."""
    port = free_port()
    servers: list[ThreadServer] = []
    starter = threading.Timer(1.5, lambda: servers.append(ThreadServer(sqlite(tmp_path), port=port).__enter__()))
    starter.start()
    try:
        client = StrategyClient(f"http://127.0.0.1:{port}", retry_s=30)
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO, logger="atorch"):
            name = client.create_study("refused", grid(), 1e9)["study_key"]
        took = time.monotonic() - t0
        assert 1.5 <= took < 20, took
        assert client.ask(name)["number"] is not None
    finally:
        starter.join()
        for server in servers:
            server.__exit__(None, None, None)
    (warning,) = retry_warnings(caplog)
    assert "unreachable" in warning and "ConnectError" in warning and "ATORCH_SERVER_RETRY_S" in warning
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_past_the_deadline_the_error_names_the_url_the_last_error_and_the_setting(monkeypatch, caplog) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("ATORCH_SERVER_RETRY_S", "1.5")
    client = StrategyClient(url)
    assert client.retry_s == 1.5
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="atorch"), pytest.raises(SetupError) as raised:
        client.trials("x")
    took = time.monotonic() - t0
    message = str(raised.value)
    assert 1.5 <= took < 5, took
    assert url in message and "ConnectError" in message and "$ATORCH_SERVER_RETRY_S (now 1.5 s)" in message
    assert "retry_s=" in message and "atorch serve" in message
    attempts = int(message.split(" failed ")[1].split(" time")[0])
    assert attempts >= 4 and len(retry_warnings(caplog)) == 1  # several attempts, one line
    t0 = time.monotonic()
    with pytest.raises(SetupError, match="failed 1 time"):
        StrategyClient(url, retry_s=0).trials("x")  # 0: no retry
    assert time.monotonic() - t0 < 1
    with pytest.raises(SetupError, match="retry_s must be"):
        StrategyClient(url, retry_s=-1)


class Scripted(http.server.ThreadingHTTPServer):
    """A plain HTTP server answering each path from a script: (status, headers) per request, then 200."""

    def __init__(self, script: dict[str, list[tuple[int, dict[str, str]]]]) -> None:
        self.script, self.seen = script, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler) -> None:  # noqa: N805 (the handler, not the server)
                self.seen.append((time.monotonic(), handler.path))
                steps = self.script.get(handler.path, [])
                status, headers = steps.pop(0) if steps else (200, {})
                body = json.dumps({"detail": f"scripted {status}"} if status >= 400 else {"ok": True}).encode()
                handler.send_response(status)
                for k, v in {**headers, "Content-Type": "application/json", "Content-Length": str(len(body))}.items():
                    handler.send_header(k, v)
                handler.end_headers()
                handler.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def times(self, path: str) -> list[float]:
        return [t for t, p in self.seen if p == path]


def test_429_502_503_504_are_retried_honouring_retry_after_and_other_errors_are_final() -> None:
    script = {"/healthz": [(503, {"Retry-After": "1"}), (429, {"Retry-After": "0"}), (502, {}), (504, {})],
              "/gone": [(404, {})], "/broken": [(500, {})], "/conflict": [(409, {})],
              "/slow": [(503, {"Retry-After": "30"})] * 2}
    server = Scripted(script)
    try:
        client = StrategyClient(server.url, retry_s=20)
        assert client.health() == {"ok": True}
        times = server.times("/healthz")
        assert len(times) == 5 and times[1] - times[0] >= 1.0  # the server's Retry-After: 1, honoured
        for path, status in (("/gone", 404), ("/broken", 500), ("/conflict", 409)):
            with pytest.raises(ServerError, match=f"answered {status}") as raised:
                client._call("GET", path)
            assert raised.value.status_code == status and len(server.times(path)) == 1  # not retried
        t0 = time.monotonic()
        with pytest.raises(SetupError, match=r"kept failing.*last error: 503 scripted 503.*now 2 s"):
            StrategyClient(server.url, retry_s=2)._call("GET", "/slow")  # a Retry-After past the deadline: cut to it
        assert 2 <= time.monotonic() - t0 < 6 and len(server.times("/slow")) == 2
    finally:
        server.shutdown()
        server.server_close()
    assert retry_after(httpx.Response(503, headers={"Retry-After": "2.5"})) == 2.5
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 < retry_after(httpx.Response(503, headers={"Retry-After": date})) <= 30
    assert retry_after(httpx.Response(503)) is None
    assert retry_after(httpx.Response(503, headers={"Retry-After": "soon"})) is None


def test_lost_answers_are_retried_without_counting_a_tell_twice(tmp_path) -> None:
    """The server stores a tell and an ask and their answers never arrive (the connection drops): the retried
    tell is answered ``already_told``, stored once, and still reports that it improved the best; the retried ask
    hands out another trial, the lost one stays leased (until its lease expires), and a search goes on to the
    end."""
    storage = sqlite(tmp_path)
    with ThreadServer(storage) as server:
        proxy = LossyProxy(server.port)
        args = dict(server_url=proxy.url, predict=predict, memory_budget=BUDGET, max_trials=6, retry_s=30)
        study = RemotePlanner(landscape_space(), study_key="lost-tell", measure=Measure(), **args).search_study()
        study.start(force=True)
        proposal = study.ask(lambda: "")
        cand = landscape_space().from_point(proposal.point)
        proxy.lose("/tell")
        told = study.tell(proposal.number, Measured.of(Measure()(cand)))
        assert told["improved"] is True and told["status"] == "ok"  # the first measurement: the best so far
        measure = Measure()

        def lossy_measure(cand):
            if len(measure.calls) == 1:
                proxy.lose("/tell")
            if len(measure.calls) == 2:
                proxy.lose("/ask")
            return measure(cand)

        planner = RemotePlanner(landscape_space(), study_key="lost-ask", measure=lossy_measure, **args)
        result = planner.search()
        proxy.close()
    assert [line.split()[1].rsplit("/", 1)[-1] for line in proxy.lost] == ["tell", "tell", "ask"], proxy.lost
    lost_tell = stored_trials(storage, study.key)
    assert [(t.number, t.state.name, t.user_attrs["status"]) for t in lost_tell if "measured" in t.user_attrs] == [
        (proposal.number, "COMPLETE", "ok")]
    assert result.candidate is not None and result.dry_runs == len(measure.calls) >= 4
    trials = stored_trials(storage, planner.server_study)
    told = [t for t in trials if "measured" in t.user_attrs]
    keys = [t.user_attrs["key"] for t in told]
    assert sorted(keys) == sorted(c.key for c in measure.calls)  # each measured once, stored once
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in told)
    (abandoned,) = [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert "lease_expires" in abandoned.user_attrs and abandoned.user_attrs["key"] not in keys


def test_a_search_rides_out_a_server_killed_and_restarted_mid_search(tmp_path, caplog) -> None:
    """``atorch serve`` on a SQLite file is killed with SIGKILL while a RemotePlanner measures its third
    candidate, and a server is started again on the same port and file 3 s later (in this process: starting
    ``atorch serve`` again costs 5 to 20 s on a busy machine and tests nothing more). The search completes, and
    every trial it told is in the storage once."""
    storage = sqlite(tmp_path)
    server = ProcessServer(storage).start()
    restarted: list[ThreadServer] = []

    def restart() -> None:
        time.sleep(3.0)
        restarted.append(ThreadServer(storage, port=server.port).__enter__())

    restarter = threading.Thread(target=restart)
    measure = Measure(sleep_s=0.1)

    def killing_measure(cand):
        if len(measure.calls) == 2:  # the third dry-run: its tell meets a dead server
            server.kill()
            restarter.start()
        return measure(cand)

    try:
        planner = RemotePlanner(landscape_space(), server_url=server.url, study_key="restart", predict=predict,
                                measure=killing_measure, memory_budget=BUDGET, max_trials=8, retry_s=60)
        with caplog.at_level(logging.INFO, logger="atorch"):
            result = planner.search()
    finally:
        server.kill()
        if restarter.is_alive() or restarted:
            restarter.join()
            restarted[0].__exit__(None, None, None)
    assert result.source == "search" and result.candidate is not None, result
    assert result.dry_runs == len(measure.calls) >= 4
    (warning,) = retry_warnings(caplog)
    assert "unreachable" in warning and "/tell" in warning
    again = [r.getMessage() for r in caplog.records if "answers again" in r.getMessage()]
    assert len(again) == 1 and "/tell" in again[0]
    trials = stored_trials(storage, planner.server_study)
    told = [t for t in trials if "measured" in t.user_attrs]
    keys = [t.user_attrs["key"] for t in told]
    assert sorted(keys) == sorted(c.key for c in measure.calls)  # every dry-run told, and stored once
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in told)
    assert not [t.number for t in trials if t.state == optuna.trial.TrialState.RUNNING]
