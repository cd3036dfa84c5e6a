"""The strategy server's smaller guards, each against a real uvicorn on 127.0.0.1: study keys every route takes,
strict numbers, the token's safe forms (a file, the environment; never blank), an expiring sign-in cookie, and
a 429 for an address that keeps sending wrong tokens."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from server_harness import ROOT, ThreadServer, free_port, serve_command, wait_healthy
from test_server import TOKEN, sqlite
from test_server_failures import grid

from atorch.cli import main
from atorch.errors import SetupError
from atorch.server.auth import COOKIE, SESSION_S, FailedTokens, cookie_of
from atorch.server.models import MAX_KEY
from atorch.server.serve import check_bind, resolve_token

BUDGET = 1e9


@pytest.fixture(scope="module")
def table() -> dict:
    return grid(2, 4)


def test_a_key_is_refused_at_create_past_the_length_every_route_takes(table, tmp_path) -> None:
    with ThreadServer(sqlite(tmp_path)) as server:
        url = server.url
        r = httpx.put(f"{url}/v1/studies/{'k' * (MAX_KEY + 1)}", json={"table": table, "memory_budget": BUDGET})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "study_key"], r.text[:300]
        assert f"at most {MAX_KEY} characters" in r.json()["detail"][0]["msg"]
        assert httpx.get(f"{url}/v1/studies").json() == []
        name = httpx.put(f"{url}/v1/studies/{'k' * MAX_KEY}", json={"table": table, "memory_budget": BUDGET}).json()[
            "study_key"]
        p = httpx.post(f"{url}/v1/studies/{name}/ask", json={}).json()  # the longest name: used by every route
        assert httpx.post(f"{url}/v1/studies/{name}/trials/{p['number']}/tell",
                          json={"measured": {"status": "ok", "samples_per_s": 1.0}}).status_code == 200
        for path in ("", "/trials", "/best", "/contenders?within=0.1"):
            assert httpx.get(f"{url}/v1/studies/{name}{path}").status_code == 200, path
        assert httpx.delete(f"{url}/v1/studies/{name}").status_code == 204


def test_numbers_are_json_numbers(table, tmp_path) -> None:
    """``true`` or ``"5"`` where a number is taken is a 422 naming the field, not 1 or 5; an integer field takes
    no fraction."""
    with ThreadServer(sqlite(tmp_path)) as server:
        url = server.url
        for field, bad in (("memory_budget", True), ("memory_budget", "5"), ("lease_s", "60"), ("max_trials", 8.5),
                           ("seed", True), ("top_k", "3")):
            r = httpx.put(f"{url}/v1/studies/n", json={"table": table, "memory_budget": BUDGET, field: bad})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", field], (field, bad, r.text)
        r = httpx.put(f"{url}/v1/studies/n", json={"table": {**table, "global_batch": "8"}, "memory_budget": BUDGET})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "table", "global_batch"]
        assert httpx.get(f"{url}/v1/studies").json() == []  # nothing written
        name = httpx.put(f"{url}/v1/studies/n", json={"table": table, "memory_budget": 1e12}).json()["study_key"]
        for bad in ({"memory_budget": True}, {"lease_s": "60"}):
            r = httpx.post(f"{url}/v1/studies/{name}/ask", json=bad)
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", *bad], r.text
        p = httpx.post(f"{url}/v1/studies/{name}/ask", json={}).json()
        tell = f"{url}/v1/studies/{name}/trials/{p['number']}/tell"
        for field, bad in (("samples_per_s", "5"), ("peak_memory_bytes", True), ("step_time_s", "0.1")):
            r = httpx.post(tell, json={"measured": {"status": "ok", "samples_per_s": 1, field: bad}})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "measured", field], r.text
        assert httpx.post(tell, json={"measured": {"status": "ok", "samples_per_s": 5, "peak_memory_bytes": 1}}
                          ).json()["record"]["measured"]["samples_per_s"] == 5


def test_a_blank_token_is_refused_and_the_safe_forms_are_a_file_and_the_environment(tmp_path, monkeypatch) -> None:
    for blank in ("", "   ", "\t\n"):
        with pytest.raises(SetupError, match="empty or only whitespace"):
            check_bind("0.0.0.0", blank)
        assert main(["serve", "--host", "0.0.0.0", "--port", "1", "--token", blank]) == 2
    monkeypatch.setenv("ATORCH_SERVER_TOKEN", "  ")
    with pytest.raises(SetupError, match="empty or only whitespace"):
        resolve_token(None, None)
    monkeypatch.setenv("ATORCH_SERVER_TOKEN", TOKEN)
    assert resolve_token(None, None) == TOKEN
    with pytest.raises(SetupError, match="whitespace"):
        resolve_token(" padded", None)
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    token_file.chmod(0o600)
    assert resolve_token(None, str(token_file)) == "from-a-file"  # the file's, before the environment's
    with pytest.raises(SetupError, match="not both"):
        resolve_token(TOKEN, str(token_file))
    with pytest.raises(SetupError, match="cannot read the token file"):
        resolve_token(None, str(tmp_path / "missing"))
    blank = tmp_path / "blank"
    blank.write_text("\n")
    assert main(["serve", "--host", "0.0.0.0", "--port", "1", "--token-file", str(blank)]) == 2
    # A real `atorch serve --token-file`: the token is nowhere on its command line, and it is the one required.
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "ATORCH_SERVER_TOKEN"}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(serve_command(sqlite(tmp_path), port, "--token-file", str(token_file)), cwd=ROOT,
                            env={**env, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc=proc)
        assert "from-a-file" not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        assert httpx.get(f"{url}/v1/studies").status_code == 401
        assert httpx.get(f"{url}/v1/studies", headers={"Authorization": "Bearer from-a-file"}).json() == []
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()


def test_the_sign_in_cookie_expires(tmp_path) -> None:
    with ThreadServer(sqlite(tmp_path), token=TOKEN) as server:
        url = server.url
        r = httpx.post(f"{url}/ui/login", data={"token": TOKEN})
        assert r.status_code == 303 and f"Max-Age={SESSION_S}" in r.headers["set-cookie"], r.headers["set-cookie"]
        assert httpx.get(f"{url}/ui/", cookies={COOKIE: r.cookies[COOKIE]}).status_code == 200
        assert httpx.get(f"{url}/v1/studies", cookies={COOKIE: r.cookies[COOKIE]}).status_code == 200
        old = cookie_of(TOKEN, now=time.time() - SESSION_S - 1)  # signed by this token, expired a second ago
        expires, _, signature = cookie_of(TOKEN).partition(".")
        forged = f"{int(expires) + 10**6}.{signature}"  # a later expiry under the same signature
        for cookie in (old, forged):
            assert httpx.get(f"{url}/ui/", cookies={COOKIE: cookie}).status_code == 401
            assert httpx.get(f"{url}/v1/studies", cookies={COOKIE: cookie}).status_code == 401


def test_an_address_sending_wrong_tokens_gets_429_and_right_ones_are_never_slowed(tmp_path) -> None:
    """3 wrong tokens within the window: that address's next tokens, right or wrong, are a 429 with Retry-After
    (on the API, the dashboards and the sign-in form); a sign-in cookie still works; the window passes and the
    right token works again. Right tokens before that are answered at once and never counted."""
    failures = FailedTokens(limit=3, window_s=3.0)
    with ThreadServer(sqlite(tmp_path), token=TOKEN, failures=failures) as server:
        url = server.url
        good, bad = {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": "Bearer wrong"}
        cookie = {COOKIE: httpx.post(f"{url}/ui/login", data={"token": TOKEN}).cookies[COOKIE]}
        took = []
        for _ in range(20):  # right tokens: never counted
            t0 = time.perf_counter()
            assert httpx.get(f"{url}/v1/studies", headers=good).status_code == 200
            took.append(time.perf_counter() - t0)
        # never delayed: a delay would slow every request; one request on a loaded machine may take a second
        assert statistics.median(took) < 1.0, took
        for _ in range(3):
            assert httpx.get(f"{url}/v1/studies", headers=bad).status_code == 401
        for path, headers in (("/v1/studies", bad), ("/v1/studies", good), ("/ui/", good), ("/dashboard", good)):
            r = httpx.get(f"{url}{path}", headers=headers)
            assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 3, (path, r.status_code)
            assert "too many wrong tokens" in r.json()["detail"]
        assert httpx.post(f"{url}/ui/login", data={"token": TOKEN}).status_code == 429
        assert httpx.get(f"{url}/v1/studies", cookies=cookie).status_code == 200  # an HMAC is not guessed
        assert httpx.get(f"{url}/v1/studies").status_code == 401  # no token: not a guess, not limited
        time.sleep(3.1)
        assert httpx.get(f"{url}/v1/studies", headers=good).status_code == 200


def test_a_storage_error_names_the_database_s_own_error(tmp_path) -> None:
    """Optuna wraps a failed commit in a text about "invalid data ... exceeding max length", whatever happened; the
    server's 503 names what the database said (here a real read-only SQLite connection)."""
    import optuna

    from atorch.server.store import storage_error_text

    writable = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/a.db")
    sid = writable.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "s")
    read_only = optuna.storages.RDBStorage(f"sqlite:///file:{tmp_path}/a.db?mode=ro&uri=true")
    with pytest.raises(optuna.exceptions.StorageInternalError, match="exceeding max length") as caught:
        read_only.set_study_user_attr(sid, "x", 1)
    assert storage_error_text(caught.value) == "sqlite3.OperationalError: attempt to write a readonly database"
    writable.engine.dispose()
    read_only.engine.dispose()
