"""Run a script under torchrun with N real processes (gloo) and collect what rank 0 reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _launch(script: str | Path, args: tuple[str, ...], nproc: int, timeout: float) -> subprocess.CompletedProcess:
    # PYTHONFAULTHANDLER: a launch that hangs is stopped with SIGABRT, on which every process prints where each of
    # its threads stands; that output is then read (a plain kill leaves nothing to say where it hung)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]),
               PYTHONFAULTHANDLER="1")
    # --standalone: torchrun picks a free rendezvous port itself (no race between probing and binding).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _stop(proc)
        raise AssertionError(f"{script} timed out after {timeout}s (each process's threads, as SIGABRT found "
                             f"them, are at the end):\n{out[-4000:]}\n{err[-12000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (torchrun's workers, each in a session of its own), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _signal_sessions(pids: list[int], sig: int) -> None:
    """``sig`` to each worker and to what it started (a DataLoader's worker processes): its whole process group
    where the worker leads one (torchrun starts each in a session of its own), else the worker alone. A forked child
    keeps the launch's output pipes open: one left running hid every process's threads, and the launch never ended
    (a data worker under two CI runs side by side: "no output: the launch did not end")."""
    for pid in pids:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """End a hung launch: SIGABRT to the workers and their children (faulthandler prints each one's threads), then
    torchrun and what is left are killed, and their output read."""
    workers = _children(proc.pid)
    _signal_sessions(workers, signal.SIGABRT)
    try:
        return proc.communicate(timeout=20)  # torchrun sees its workers die and ends
    except subprocess.TimeoutExpired:
        _signal_sessions(workers, signal.SIGKILL)
        _signal([*_children(proc.pid), proc.pid], signal.SIGKILL)
    try:
        return proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        return "", "(no output: the launch did not end)"


def launch(script: str | Path, *args: str, nproc: int = 2, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Launch ``script`` on nproc local processes and return how it ended, whatever its exit status."""
    return _launch(script, args, nproc, timeout)


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Launch ``script`` on nproc local processes; raises with the output on failure or time-out.

    There is no retry: a launch that fails is a failure to fix, not to hide.
    """
    proc = _launch(script, args, nproc, timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_failing(script: str | Path, *args: str, nproc: int = 2, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Launch ``script``, which is meant to fail (a rank that kills itself); raises if it exits 0."""
    proc = _launch(script, args, nproc, timeout)
    if proc.returncode == 0:
        raise AssertionError(f"{script} was meant to fail but exited 0:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def run_json(script: str | Path, *args: str, nproc: int = 2, timeout: float = 300.0) -> dict:
    """Launch and parse the last stdout line that starts with 'RESULT ' as JSON."""
    proc = torchrun(script, *args, nproc=nproc, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise AssertionError(f"{script} printed no RESULT line:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_json_nodes(script: str | Path, node_args: list[tuple[str, ...]], nproc: int = 2,
                   timeout: float = 300.0) -> dict:
    """A multi-node job on this machine: one torchrun launcher per entry of ``node_args`` (that node's script
    arguments), ``--nnodes len(node_args) --node-rank i --rdzv-backend c10d`` on a local endpoint, ``nproc``
    processes each; the JSON of the 'RESULT ' line printed by global rank 0 (on whichever node it is). A node
    that fails stops the others (they would wait for it in their next collective)."""
    import contextlib
    import tempfile
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    endpoint = f"127.0.0.1:{_free_port()}"
    with contextlib.ExitStack() as stack:
        files = [(stack.enter_context(tempfile.TemporaryFile("w+")), stack.enter_context(tempfile.TemporaryFile("w+")))
                 for _ in node_args]
        procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(node_args)}", f"--node-rank={i}",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=atorch-test",
             f"--nproc-per-node={nproc}", str(script), *args], stdout=out, stderr=err, text=True, env=env)
            for i, (args, (out, err)) in enumerate(zip(node_args, files, strict=True))]
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + 20):
                for proc in procs:  # SIGTERM: torchrun stops its workers before it exits
                    if proc.poll() is None:
                        proc.terminate()
                        try:
                            proc.wait(timeout=15)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            proc.wait()
                break
            time.sleep(0.2)
        texts = []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
    codes = [p.returncode for p in procs]
    if any(codes):
        why = "timed out" if time.monotonic() > deadline else f"exit codes {codes}"
        raise AssertionError(f"{script} {why}:\n" + "\n".join(
            f"--- node {i}:\n{o[-3000:]}\n{e[-6000:]}" for i, (o, e) in enumerate(texts)))
    lines = [line for out, _ in texts for line in out.splitlines() if line.startswith("RESULT ")]
    if len(lines) != 1:
        raise AssertionError(f"{script}: {len(lines)} RESULT lines:\n" + "\n".join(o[-2000:] for o, _ in texts))
    return json.loads(lines[0][len("RESULT "):])


def launch_fixture(script: str | Path, *, timeout: float, groups: dict[str, int] | None = None) -> Any:
    """A module-scoped ``launch`` fixture: the report of one run of ``script`` on 2 processes; with ``groups``
    (group -> processes), one run per group, the group as the script's argument: ``(group, report)``."""
    import pytest

    if groups is None:
        @pytest.fixture(scope="module", name="launch")
        def launch_once() -> dict[str, Any]:
            return run_json(script, timeout=timeout)

        return launch_once

    @pytest.fixture(scope="module", params=list(groups), name="launch")
    def launch_group(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
        group = request.param
        return group, run_json(script, group, nproc=groups[group], timeout=timeout)

    return launch_group
