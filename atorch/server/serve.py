"""``atorch serve``: checks the address and token, then runs the app under uvicorn.

The token comes from ``--token-file`` or ``$ATORCH_SERVER_TOKEN`` (the safe forms: a command line is readable by
every user of the machine, in ``ps`` and ``/proc``), or ``--token`` (kept, with a warning).
"""

from __future__ import annotations

import gc
import ipaddress
import socket
import stat
import sys
from pathlib import Path

from atorch.errors import SetupError
from atorch.log import get_logger
from atorch.settings import settings

logger = get_logger(__name__)

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


def check_token(token: str | None) -> None:
    if token is None:
        return
    if not token.strip():
        raise SetupError("the server's token is empty or only whitespace: anyone could send it. Give a real secret "
                         "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`) in --token-file or "
                         "$ATORCH_SERVER_TOKEN.")
    if token != token.strip():
        raise SetupError("the server's token starts or ends with whitespace, which an Authorization header does not "
                         "carry: remove it")


def resolve_token(token: str | None, token_file: str | None) -> str | None:
    """The server's token: ``--token-file`` (its text, without the surrounding whitespace of a file's last line),
    else ``--token``, else ``$ATORCH_SERVER_TOKEN``; checked (``check_token``)."""
    if token is not None and token_file is not None:
        raise SetupError("give --token-file or --token, not both (--token-file is the safe one)")
    if token_file is not None:
        path = Path(token_file)
        try:
            token = path.read_text().strip()
            mode = path.stat().st_mode
        except (OSError, UnicodeDecodeError) as exc:
            raise SetupError(f"cannot read the token file {token_file} ({exc}): fix the path or its "
                             "permissions") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("the token file %s can be read by other users: chmod 600 it", token_file)
    elif token is not None:
        logger.warning("--token is visible to every user of this machine (ps, /proc/<pid>/cmdline): prefer "
                       "--token-file or $ATORCH_SERVER_TOKEN")
    else:
        token = settings().server_token
    check_token(token)
    return token


def check_bind(host: str, token: str | None) -> None:
    check_token(token)
    if token is None and not is_loopback(host):
        raise SetupError(
            f"refusing to serve on {host!r} without a token: anyone who can reach it could read and change "
            "the searches. Give a token in --token-file or $ATORCH_SERVER_TOKEN, or bind 127.0.0.1."
        )


def serve(host: str, port: int, storage: str | None, token: str | None, max_body: int,
          token_file: str | None = None) -> int:
    import uvicorn

    from atorch.server.app import create_app
    from atorch.strategy_search.search.planner import default_storage

    # How long a write waits for a locked SQLite file before the request is a 503 (the client retries).
    busy = settings().server_busy_timeout_s
    try:
        token = resolve_token(token, token_file)
        check_bind(host, token)
        # Takes the one-server lock of a SQLite file (refused, naming the server holding it) before binding.
        app = create_app(storage or default_storage(), token=token, max_body=max_body, busy_timeout_s=busy,
                         address=f"http://{host}:{port}")
    except SetupError as exc:
        print(f"atorch serve: {exc}", file=sys.stderr)
        return 2
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # What is loaded by now (torch, Optuna, SQLAlchemy, FastAPI: most of the heap) lives as long as the process: out
    # of the collector's way. Each full collection walked it, 110-170 ms with every thread stopped (a /healthz p99 of
    # 129 ms at 32 clients); the objects requests make are still collected.
    gc.freeze()
    uvicorn.run(app, host=host, port=port, log_level="info")
    return 0
