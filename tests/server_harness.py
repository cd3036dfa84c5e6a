"""A real strategy server for tests: uvicorn on 127.0.0.1 at a free port, in a thread or a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise TimeoutError(f"the server at {url} exited with {proc.returncode} before answering")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no server at {url} after {timeout_s}s")
        time.sleep(0.1)


class ThreadServer:
    """uvicorn.Server in a thread (same process: fast to start, stopped cleanly)."""

    def __init__(self, storage: str, token: str | None = None, port: int | None = None, **app_kwargs) -> None:
        import uvicorn

        from atorch.server.app import create_app

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(storage, token=token, address=self.url, **app_kwargs)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        wait_healthy(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve_command(storage: str, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "atorch.cli", "serve", "--port", str(port), "--storage", storage, *args]


def drop_file_capabilities() -> None:
    """In a child before exec: without CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER, file permissions
    bind even root (a chmod'ed read-only database is then read-only to the server, as to any other user)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone from the bounding set, so after exec
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


class ProcessServer:
    """``atorch serve`` in its own process (killed with SIGKILL to test a crash)."""

    def __init__(self, storage: str, port: int | None = None, token: str | None = None,
                 env: dict[str, str] | None = None, as_plain_user: bool = False) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.storage, self.token, self.env = storage, token, env or {}
        self.as_plain_user = as_plain_user and os.geteuid() == 0  # a non-root test is a plain user already
        self.proc: subprocess.Popen | None = None

    def start(self) -> ProcessServer:
        cmd = serve_command(self.storage, self.port)
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        if self.token:
            env["ATORCH_SERVER_TOKEN"] = self.token
        # The log goes to a file: a pipe nobody reads would block the server once it fills.
        self.log = tempfile.NamedTemporaryFile(prefix="atorch-serve-", suffix=".log", delete=False)  # noqa: SIM115 (open while the server runs)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=drop_file_capabilities if self.as_plain_user else None)
        try:
            wait_healthy(self.url, proc=self.proc)
        except TimeoutError as exc:
            self.kill()
            raise TimeoutError(f"{exc}; server log: {Path(self.log.name).read_text()[-3000:]}") from exc
        return self

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None
