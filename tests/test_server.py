"""The strategy server against a real uvicorn on 127.0.0.1 (free port), real Optuna storages, no mocks.

The landscape is test_planner's synthetic predict/measure: a RemotePlanner must find what a local
Planner finds, and a second job with the same key gets the stored best with no dry-run.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import threading
import time
import uuid

import httpx
import pytest
import toy_models
from server_harness import ProcessServer, ThreadServer
from test_planner import (
    BUDGET,
    GLOBAL_BATCH,
    WORLD,
    Measure,
    SlowFirstRun,
    landscape_space,
    predict,
    true_memory,
    true_speed,
)

from atorch.cli import main
from atorch.errors import SetupError
from atorch.server.serve import check_bind
from atorch.strategy_search.search.candidates import CandidateTable
from atorch.strategy_search.search.outcome import Predicted
from atorch.strategy_search.search.planner import Planner
from atorch.strategy_search.search.remote import RemotePlanner, ServerError, StrategyClient
from atorch.strategy_search.search.space import SearchSpace

TOKEN = "s3cret-token"
POSTGRES = os.environ.get("ATORCH_TEST_POSTGRES_URL")


@pytest.fixture(scope="module")
def space() -> SearchSpace:
    return landscape_space()


@pytest.fixture(scope="module")
def table(space) -> dict:
    return CandidateTable.from_space(space, lambda c: Predicted.estimate(predict(c), GLOBAL_BATCH).to_json()).to_json()


def sqlite(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'server.db'}"


def run_of(point: dict) -> dict:
    return {"status": "ok", "samples_per_s": true_speed(point), "peak_memory_bytes": true_memory(point), "reason": ""}


def postgres_or_skip() -> str:
    if not POSTGRES:
        pytest.skip("no PostgreSQL: set ATORCH_TEST_POSTGRES_URL (scripts/postgres.sh starts one and prints it)")
    try:
        import sqlalchemy

        sqlalchemy.create_engine(POSTGRES).connect().close()
    except Exception as exc:  # a URL that no server answers
        pytest.skip(f"PostgreSQL at ATORCH_TEST_POSTGRES_URL is not reachable: {exc}")
    return POSTGRES


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_concurrent_clients_asking_and_telling_n_trials_leave_exactly_n(backend, table, tmp_path) -> None:
    storage = sqlite(tmp_path) if backend == "sqlite" else postgres_or_skip()
    key, n, k = f"conc-{uuid.uuid4().hex[:8]}", 16, 4
    tickets = iter(range(n))
    ticket_lock = threading.Lock()
    numbers: list[int] = []
    errors: list[BaseException] = []
    with ThreadServer(storage) as server:
        key = StrategyClient(server.url).create_study(key, table, 10 * BUDGET, max_trials=n)["study_key"]  # all fit

        def job() -> None:
            client = StrategyClient(server.url)
            try:
                while True:
                    with ticket_lock:
                        if next(tickets, None) is None:
                            return
                    proposal = client.ask(key)
                    assert proposal["number"] is not None, proposal
                    told = client.tell(key, proposal["number"], run_of(proposal["point"]))
                    again = client.tell(key, proposal["number"], run_of(proposal["point"]))  # harmless
                    assert again["already_told"] and again["record"] == told["record"]
                    numbers.append(proposal["number"])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=job) for _ in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        trials = StrategyClient(server.url).trials(key)
        if backend == "postgresql":
            StrategyClient(server.url).delete(key)
    measured = [t for t in trials if "measured" in t["user_attrs"] and t["user_attrs"]["status"] != "duplicate"]
    assert len(measured) == n and sorted(numbers) == sorted(t["number"] for t in measured)
    assert len({t["user_attrs"]["key"] for t in measured}) == n  # no candidate measured twice
    assert all(t["state"] != "RUNNING" for t in trials)  # every asked trial was told


def test_a_second_server_on_one_sqlite_file_is_refused_naming_the_first(table, tmp_path) -> None:
    """One server per SQLite file: a second one (here in the same process, another spelling of the same path) is
    refused before it reads or writes anything, naming the first; once the first stops, the file is free.
    (Under load and across processes: test_server_failures.py.)"""
    from atorch.server.app import create_app

    storage = sqlite(tmp_path)
    with ThreadServer(storage) as a:
        StrategyClient(a.url).create_study("two", table, 10 * BUDGET)
        with pytest.raises(SetupError, match=rf"already served by another atorch server \(pid {os.getpid()} on .* at "
                                             rf"{a.url}.*two servers on one SQLite file"):
            create_app(f"sqlite:///{tmp_path}/sub/../server.db")
    with ThreadServer(storage) as b:  # the first stopped: the file is free
        assert [n.split(":")[0] for n in httpx.get(f"{b.url}/v1/studies").json()] == ["two"]


def test_a_request_memo_reads_each_thing_once_and_the_next_request_reads_the_storage(tmp_path) -> None:
    """RequestMemo: inside a request a running trial and the study's trials are read once (the request's own
    writes kept in the copy); another process's writes are seen by the next request; a trial's state is the
    storage's as soon as it is written."""
    import optuna
    from sqlalchemy import event

    from atorch.server.memo import RequestMemo

    url = sqlite(tmp_path)
    rdb = optuna.storages.RDBStorage(url)
    memo = RequestMemo(optuna.storages.get_storage(rdb))
    other = optuna.storages.RDBStorage(url)  # another process
    study = optuna.create_study(storage=other, study_name="m")
    sid = other.get_study_id_from_name("m")
    tid = other.get_trial_id_from_study_id_trial_number(sid, study.ask().number)
    statements = []
    event.listen(rdb.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    with memo.request():
        assert memo.get_trial(tid).user_attrs == {} and memo.get_all_trials(sid)[0].user_attrs == {}
        memo.set_trial_user_attr(tid, "a", 1)
        read = len(statements)
        assert memo.get_trial(tid).user_attrs == {"a": 1} and memo.get_all_trials(sid)[0].user_attrs == {"a": 1}
        assert len(statements) == read  # answered from the request's copy
        created = memo.create_new_trial(sid)
        assert [t.number for t in memo.get_all_trials(sid)] == [0, 1] and memo.get_trial(created).number == 1
        other.set_trial_user_attr(tid, "b", 2)  # during the request, by another process
    with memo.request():
        assert memo.get_trial(tid).user_attrs == {"a": 1, "b": 2}
        memo.set_trial_state_values(tid, optuna.trial.TrialState.COMPLETE, [1.0])
        done = memo.get_trial(tid)
        assert done.state == optuna.trial.TrialState.COMPLETE and done.datetime_complete is not None
        assert [t.state.name for t in memo.get_all_trials(sid)] == ["COMPLETE", "RUNNING"]
    rdb.engine.dispose()
    other.engine.dispose()


def test_a_study_s_trials_are_kept_between_its_turns_and_read_again_when_another_process_wrote(tmp_path) -> None:
    """RequestMemo.request(keep=True) (a request holding the study's turn): the next such request does not read the
    trials in flight again (its SQL does not grow with them); each writing request first commits a new token in
    the study's user attributes; another process's token makes the next request read the storage; a trial's
    state is read back as the storage set it; a failed request forgets what it kept."""
    import optuna
    from sqlalchemy import event

    from atorch.server.memo import WRITTEN_ATTR, RequestMemo

    url = sqlite(tmp_path)
    rdb = optuna.storages.RDBStorage(url)
    memo = RequestMemo(optuna.storages.get_storage(rdb))
    other = optuna.storages.RDBStorage(url)  # another process
    optuna.create_study(storage=other, study_name="k")
    sid = other.get_study_id_from_name("k")
    with memo.request(keep=True):
        ids = [memo.create_new_trial(sid) for _ in range(12)]
        memo.set_trial_user_attr(ids[0], "a", 1)
    token = other.get_study_user_attrs(sid)[WRITTEN_ATTR]
    statements = []
    event.listen(rdb.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    with memo.request(keep=True):
        trials = memo.get_all_trials(sid)
        assert len(trials) == 12 and memo.get_trial(ids[0]).user_attrs == {"a": 1}
        assert len(statements) <= 2  # the study's attributes (its token), not the 12 running trials
        memo.set_trial_state_values(ids[0], optuna.trial.TrialState.COMPLETE, [1.0])
    assert other.get_study_user_attrs(sid)[WRITTEN_ATTR] != token  # set before the write
    done = other.get_trial(ids[0])
    with memo.request(keep=True):
        kept = memo.get_all_trials(sid)[0]
        assert kept.state == done.state and kept.datetime_complete == done.datetime_complete
    other.set_trial_user_attr(ids[1], "b", 2)
    other.set_study_user_attr(sid, WRITTEN_ATTR, "another server")
    with memo.request(keep=True):
        assert memo.get_all_trials(sid)[1].user_attrs == {"b": 2}
    with pytest.raises(RuntimeError), memo.request(keep=True):
        memo.get_all_trials(sid)
        raise RuntimeError("the storage failed")
    other.set_trial_user_attr(ids[2], "c", 3)  # no token: seen only because the failed request forgot the study
    with memo.request(keep=True):
        assert memo.get_all_trials(sid)[2].user_attrs == {"c": 3}
    rdb.engine.dispose()
    other.engine.dispose()


def test_a_study_s_requests_take_turns_in_the_order_they_came() -> None:
    """Turns (the per-study lock): waiters get it first come, first served, and one that stopped waiting is
    skipped (a threading.Lock wakes any waiter: under 32 clients some requests waited many times the median)."""
    from atorch.server.store import Turns

    turns, order = Turns(), []
    assert turns.acquire(timeout=1)
    assert not turns.acquire(timeout=0.01)  # held: gave up, and left the queue

    def waiter(i: int) -> None:
        assert turns.acquire(timeout=30)
        order.append(i)
        turns.release()

    threads = []
    for i in range(6):
        threads.append(threading.Thread(target=waiter, args=(i,)))
        threads[-1].start()
        while len(turns._queue) < i + 1:  # queued before the next one comes
            time.sleep(0.001)
    turns.release()
    for t in threads:
        t.join(timeout=10)
    assert order == list(range(6))
    assert turns.acquire(timeout=1)  # free again


def test_remote_search_matches_local_and_a_second_job_gets_the_cached_best(space, tmp_path) -> None:
    local = Planner(space, storage=f"sqlite:///{tmp_path / 'local.db'}", study_key="k", predict=predict,
                    measure=Measure(), memory_budget=BUDGET, max_trials=8).search()
    with ThreadServer(sqlite(tmp_path), token=TOKEN) as server:
        seen: list[dict] = []
        remote_measure = Measure()
        remote = RemotePlanner(space, server_url=server.url, token=TOKEN, study_key="k", predict=predict,
                               measure=remote_measure, memory_budget=BUDGET, max_trials=8, on_trial=seen.append)
        first = remote.search()
        assert first.source == "search" and first.candidate == local.candidate
        assert first.samples_per_s == pytest.approx(local.samples_per_s)
        assert 1 <= first.dry_runs == len(remote_measure.calls) <= 8
        assert {r["number"] for r in seen} == {r["number"] for r in first.trials if "status" in r}
        assert all(true_memory(dict(c.point)) <= BUDGET for c in remote_measure.calls)  # no dry-run on an OOM
        second_measure = Measure()
        second = RemotePlanner(space, server_url=server.url, token=TOKEN, study_key="k", predict=predict,
                               measure=second_measure, memory_budget=BUDGET).search()
        assert second.source == "cache" and second.candidate == first.candidate and not second_measure.calls
        assert RemotePlanner(space, server_url=server.url, token=TOKEN, study_key="k", predict=predict,
                             measure=second_measure, memory_budget=BUDGET).plan_without_dryrun().candidate


def test_a_remote_search_confirms_a_close_runner_up_as_a_local_one_does(space, tmp_path) -> None:
    """test_planner's confirmation on a server's study: the fastest of the cost model's favourites has one slow
    run; the best and the runner-up run once more (within max_trials), the server records both second runs
    (and replays them after a restart), and the pick is the truly fastest, as in the local search."""
    local_db = f"sqlite:///{tmp_path / 'local.db'}"
    seeds = Planner(space, storage=local_db, study_key="probe", predict=predict, measure=Measure(),
                    memory_budget=BUDGET).ranked_by_cost_model()[:3]
    slowed = max(seeds, key=lambda c: true_speed(dict(c.point)))
    args = dict(study_key="c", predict=predict, memory_budget=BUDGET, max_trials=8, confirm_within=0.3)
    local = Planner(space, storage=local_db, measure=SlowFirstRun(slowed.key), **args).search()
    confirmed_line = ("; confirmation: the best and the runner-up re-measured interleaved, 1 round (2 dry-runs); "
                      "measured faster over 1 round")
    assert local.stop_reason.endswith(confirmed_line)
    with ThreadServer(sqlite(tmp_path)) as server:
        measure = SlowFirstRun(slowed.key)
        planner = RemotePlanner(space, server_url=server.url, measure=measure, **args)
        remote = planner.search()
        name = planner.server_study
        best = max(measure.calls, key=lambda c: true_speed(dict(c.point)))
        assert remote.stop_reason.endswith(confirmed_line) and remote.dry_runs == len(measure.calls) == 8
        assert remote.candidate == best == local.candidate
        assert remote.samples_per_s == pytest.approx(true_speed(dict(best.point)))
        confirmed = [c.key for c in measure.calls[-2:]]  # the runner-up, then the best, once more each
        assert best.key in confirmed and len({c.key for c in measure.calls}) == 6
        client = StrategyClient(server.url)
        # Each keeps its confirmation run on the server (back to back): the slowed first run no longer counts.
        kept = {c["key"]: c["samples_per_s"] for c in client.contenders(name, 0.99)["contenders"]}
        assert kept == {k: pytest.approx(true_speed(json.loads(k))) for k in confirmed}
        with pytest.raises(ServerError, match="no measured candidate") as refused:
            client.confirm(name, '{"unknown": 1}', {"status": "ok"})
        assert refused.value.status_code == 404
    with ThreadServer(sqlite(tmp_path)) as restarted:  # the confirmations are in the study
        replayed = StrategyClient(restarted.url).contenders(name, 0.99)["contenders"]
        assert {c["key"]: c["samples_per_s"] for c in replayed} == kept


def test_restart_mid_search_loses_nothing(table, tmp_path) -> None:
    server = ProcessServer(sqlite(tmp_path)).start()
    try:
        client = StrategyClient(server.url)
        r = client.create_study("r", table, BUDGET, max_trials=8)["study_key"]
        for _ in range(3):
            p = client.ask(r)
            client.tell(r, p["number"], run_of(p["point"]))
        pending = client.ask(r)  # asked, then the server dies before the result comes
        before = client.trials(r)
        server.kill()
        with pytest.raises(SetupError, match=server.url):
            StrategyClient(server.url, retry_s=0).trials(r)  # no retry (test_server_restart.py: the retries)
        server.start()  # same port, same storage
        after = client.trials(r)
        assert after == before
        told = client.tell(r, pending["number"], run_of(pending["point"]))
        assert told["record"]["status"] == "ok" and not told["already_told"]
        nxt = client.ask(r)  # the search continues
        assert nxt["number"] is not None and nxt["key"] not in {t["user_attrs"].get("key") for t in after
                                                                 if t["state"] == "COMPLETE"}
    finally:
        server.kill()


def test_an_expired_lease_is_marked_failed_and_the_search_goes_on(table, tmp_path) -> None:
    with ThreadServer(sqlite(tmp_path)) as server:
        client = StrategyClient(server.url)
        lk = client.create_study("l", table, BUDGET, lease_s=0.5)["study_key"]
        dead = client.ask(lk)  # its job dies: never told
        time.sleep(1.0)
        trial = next(t for t in client.trials(lk) if t["number"] == dead["number"])
        assert trial["state"] == "FAIL" and trial["user_attrs"]["status"] == "expired"
        assert "lease expired" in trial["user_attrs"]["reason"]
        with pytest.raises(SetupError, match="409"):
            client.tell(lk, dead["number"], run_of(dead["point"]))
        alive = client.ask(lk, lease_s=60)
        assert client.tell(lk, alive["number"], run_of(alive["point"]))["record"]["status"] == "ok"
        # A RemotePlanner whose dry-runs outlive the lease while another job lists the study (which marks
        # overdue trials failed; until then a late result is still taken): each tell is refused (409) and
        # the search goes on.
        space = SearchSpace(toy_models.tiny_gpt2(), WORLD, GLOBAL_BATCH)

        def slow_measure(cand):
            time.sleep(0.3)
            client.trials(slow.server_name())
            return Measure()(cand)

        slow = RemotePlanner(space, server_url=server.url, study_key="l2", predict=predict,
                             measure=slow_measure, memory_budget=BUDGET, max_trials=2, lease_s=0.1)
        result = slow.search()
        assert result.dry_runs == 2 and result.candidate is None
        assert {t["user_attrs"]["status"] for t in client.trials(slow.server_name()) if t["state"] == "FAIL"} == {
            "expired"}


def test_missing_or_wrong_token_is_401_with_no_data(table, tmp_path) -> None:
    from atorch.server.auth import FailedTokens

    # More wrong tokens than the default limit from one address: the 429 after them is test_server_hardening's.
    with ThreadServer(sqlite(tmp_path), token=TOKEN, failures=FailedTokens(limit=100)) as server:
        good = StrategyClient(server.url, TOKEN)
        secret = good.create_study("secret-study", table, BUDGET)["study_key"]
        routes = [("GET", "/v1/studies"), ("GET", "/v1/studies/secret-study"),
                  ("GET", "/v1/studies/secret-study/trials"), ("GET", "/v1/studies/secret-study/best"),
                  ("POST", "/v1/studies/secret-study/ask"), ("DELETE", "/v1/studies/secret-study"),
                  ("GET", "/ui/"), ("GET", "/dashboard"), ("GET", "/api/studies")]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            for method, path in routes:
                r = httpx.request(method, server.url + path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.json() == {"detail": "missing or wrong bearer token"} and "secret" not in r.text
        assert httpx.get(server.url + "/healthz").status_code == 200
        assert good.study(secret)["study_key"] == secret
        with pytest.raises(SetupError, match="ATORCH_SERVER_TOKEN"):
            StrategyClient(server.url, "wrong").trials(secret)
    with pytest.raises(SetupError, match="without a token"):
        check_bind("0.0.0.0", None)
    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2  # refused before binding anything
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", TOKEN)


def test_malformed_payloads_are_422_naming_the_field_and_big_ones_413(table, tmp_path) -> None:
    limit = len(json.dumps({"table": table, "memory_budget": BUDGET})) + 1000
    with ThreadServer(sqlite(tmp_path), max_body=limit) as server:
        url = server.url
        r = httpx.put(f"{url}/v1/studies/m", json={"table": {**table, "predictions": table["predictions"][:-1]},
                                                    "memory_budget": BUDGET})
        assert r.status_code == 422 and "predictions" in r.text
        r = httpx.put(f"{url}/v1/studies/m", json={"table": table, "memory_budget": -1})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "memory_budget"]
        r = httpx.put(f"{url}/v1/studies/m", json={"table": table, "memory_budget": BUDGET})
        assert r.status_code == 200
        m = r.json()["study_key"]
        p = httpx.post(f"{url}/v1/studies/{m}/ask", json={}).json()
        r = httpx.post(f"{url}/v1/studies/{m}/trials/{p['number']}/tell", json={"measured": {"status": "ok",
                       "samples_per_s": "fast"}})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "measured", "samples_per_s"]
        r = httpx.post(f"{url}/v1/studies/bad key!/ask", json={})
        assert r.status_code == 422 and "study_key" in r.text
        assert httpx.post(f"{url}/v1/studies/nope/ask", json={}).status_code == 404
        big = {"table": table, "memory_budget": BUDGET, "pad": "x" * limit}
        assert httpx.put(f"{url}/v1/studies/m", json=big).status_code == 413


def test_unreachable_server_is_a_clear_setup_error(space) -> None:
    from server_harness import free_port

    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(SetupError, match=rf"{url} is unreachable.*atorch serve.*ATORCH_SERVER_RETRY_S"):
        RemotePlanner(space, server_url=url, predict=predict, measure=Measure(), memory_budget=BUDGET,
                      retry_s=0.5).search()
    assert 0.5 <= time.monotonic() - t0 < 10  # retried until the deadline, then the error


class StatusCount:
    """ASGI wrapper counting the answers by route and status (which of schemathesis's cases got past validation)."""

    def __init__(self, app) -> None:
        self.app, self.counts = app, collections.Counter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        parts = scope["path"].split("/")
        route = "/".join("{}" if i > 1 and parts[i - 1] in ("studies", "trials") else p for i, p in enumerate(parts))

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                self.counts[(scope["method"], route, message["status"])] += 1
            await send(message)

        await self.app(scope, receive, sending)


@pytest.mark.skipif(shutil.which("schemathesis") is None, reason="schemathesis is not installed")
def test_schemathesis_finds_no_server_error(table, tmp_path) -> None:
    """schemathesis's generated cases (examples, coverage, fuzzing) and its stateful phase, which follows the
    OpenAPI links (a PUT's ``study_key`` into the study's routes, an ask's trial into its tell), each body also
    with a number made NaN or +-Infinity (tests/schemathesis_hooks.py): no 5xx, and the deep routes are reached
    with a 2xx (an ask, a tell)."""
    server = ThreadServer(sqlite(tmp_path), token=TOKEN)
    counting = StatusCount(server.app)
    server.server.config.app = counting  # uvicorn loads it as the server starts
    with server:
        client = StrategyClient(server.url, TOKEN)
        name = client.create_study("s", table, BUDGET)["study_key"]
        number = client.ask(name)["number"]
        # The study's routes get this study's name, and tell this asked trial (else nearly every case is a 404 for
        # an unknown study); its DELETE is left out (a deleted study would make the rest 404s).
        config = tmp_path / "schemathesis.toml"
        config.write_text(f'[parameters]\n"path.study_key" = "{name}"\n"path.number" = {number}\n')
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
               "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run(
            ["schemathesis", "--config-file", str(config), "run", f"{server.url}/openapi.json",
             "--checks", "not_a_server_error",
             "--max-examples", "15", "--seed", "1", "-H", f"Authorization: Bearer {TOKEN}",
             "--request-timeout", "30", "--phases", "examples,coverage,fuzzing,stateful",
             "--exclude-operation-id", "delete_study"],
            capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env,  # its cache stays out of the tree
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
        assert StrategyClient(server.url, TOKEN).health() == {"status": "ok", "storage": "ok"}
    counts = counting.counts
    ok = {k: n for k, n in counts.items() if 200 <= k[2] < 300}
    print(f"schemathesis: {sum(counts.values())} requests, {sum(ok.values())} answered 2xx:",
          sorted(f"{m} {r} {st}: {n}" for (m, r, st), n in counts.items()))
    assert not [k for k in counts if k[2] >= 500]
    assert ok.get(("POST", "/v1/studies/{}/ask", 200)) and ok.get(("POST", "/v1/studies/{}/trials/{}/tell", 200))
    assert counts[("PUT", "/v1/studies/{}", 422)]  # NaN / Infinity refused


def test_a_second_server_on_the_same_postgresql_study_is_refused(table) -> None:
    storage = postgres_or_skip()
    key = f"two-{uuid.uuid4().hex[:8]}"
    with ThreadServer(storage) as a, ThreadServer(storage) as b:
        name = StrategyClient(a.url).create_study(key, table, BUDGET)["study_key"]
        with pytest.raises(SetupError, match="409.*another atorch server"):
            StrategyClient(b.url).ask(name)
        StrategyClient(a.url).delete(name)
        StrategyClient(b.url).create_study(key, table, BUDGET)  # the lock went with the study
        StrategyClient(b.url).delete(name)
