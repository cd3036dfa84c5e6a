"""``atorch serve``: checks the address and token, then runs the app under uvicorn."""

from __future__ import annotations

import gc
import ipaddress
import socket
import sys

from atorch.errors import SetupError
from atorch.settings import settings

# The interpreter's GIL switch interval in the server process (default 5 ms). A study's requests take turns, and
# the one whose turn it is gives the GIL up at each of its ~30 SQL calls; with the default interval it may then wait
# up to 5 ms for the event loop or a finishing worker to hand it back. At 32 clients (bench/server.py, 64 pairs,
# alternating runs): SQLite 52.8 / 59.9 req/s at 5 ms, 57.1 / 66.2 at 1 ms; PostgreSQL 32.8 / 37.4 and 40.1 / 40.9.
SWITCH_INTERVAL_S = 0.001


def is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_bind(host: str, token: str | None) -> None:
    if token is None and not is_loopback(host):
        raise SetupError(
            f"refusing to serve on {host!r} without a token: anyone who can reach it could read and change "
            "the searches. Pass --token (or set ATORCH_SERVER_TOKEN), or bind 127.0.0.1."
        )


def serve(host: str, port: int, storage: str | None, token: str | None, max_body: int) -> int:
    import uvicorn

    from atorch.server.app import create_app
    from atorch.strategy_search.planner import default_storage

    token = token or settings().server_token
    try:
        check_bind(host, token)
    except SetupError as exc:
        print(f"atorch serve: {exc}", file=sys.stderr)
        return 2
    # How long a write waits for a locked SQLite file before the request is a 503 (the client retries).
    busy = settings().server_busy_timeout_s
    app = create_app(storage or default_storage(), token=token, max_body=max_body, busy_timeout_s=busy)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # What is loaded by now (torch, Optuna, SQLAlchemy, FastAPI: most of the heap) lives as long as the process: out
    # of the collector's way. Each full collection walked it, 110-170 ms with every thread stopped (a /healthz p99 of
    # 129 ms at 32 clients); the objects requests make are still collected.
    gc.freeze()
    uvicorn.run(app, host=host, port=port, log_level="info")
    return 0
