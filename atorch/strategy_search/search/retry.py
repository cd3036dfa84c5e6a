"""When the strategy server's client tries a request again, and how long it waits in between.

A server that restarts (a deploy, ``kill -9`` and a supervisor, a database failing over) refuses or drops
connections for as long as it takes to start, often tens of seconds; a proxy in front of it answers 502/504
meanwhile, and the server itself answers 503 (its storage failed: nothing was stored) or 429. Every job
searching at that moment should ride it out, so these are retried, with growing waits, until a deadline
(``retry_s``: $ATORCH_SERVER_RETRY_S, default 120 s, longer than a server takes to start). Any other
answer (a 4xx, a 500) is final. Retrying is safe for every route: create, store_best and delete are
idempotent, a tell repeated after its answer was lost is answered ``already_told`` and changes nothing, and
a trial handed out by an ask whose answer was lost is abandoned: its lease expires and its candidate can be
asked again.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from typing import Any

RETRY_ENV = "ATORCH_SERVER_RETRY_S"
RETRIED_STATUS = frozenset({429, 502, 503, 504})
FIRST_WAIT_S, MAX_WAIT_S = 0.25, 5.0  # doubling from 0.25 s; at most 5 s, so a restarted server is seen soon
LOG_EVERY_S = 10.0  # a client logs a retry at most this often, whatever the number of attempts


def transient(exc: BaseException) -> bool:
    """A transport failure a restarting or overloaded server causes: refused, reset or dropped connections and
    time-outs (connect, read, write, pool). Not a bad URL or an unsupported scheme: those never heal."""
    import httpx

    return isinstance(exc, httpx.TimeoutException | httpx.NetworkError | httpx.RemoteProtocolError)


def retry_after(response: Any) -> float | None:
    """The server's Retry-After (seconds or an HTTP date) in seconds, or None when absent or unreadable."""
    value = response.headers.get("retry-after", "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


class Backoff:
    """One request's retries, from its first failure until ``deadline_s`` later."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.start = time.monotonic()
        self.attempts = 1  # the one that failed

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def remaining(self) -> float:
        return self.deadline_s - self.elapsed()

    def wait(self, hint_s: float | None) -> bool:
        """Sleep before the next attempt: the server's Retry-After when it gave one (never sooner: it said when to
        come back), else a doubling wait. Both are spread by jitter, so the jobs a restart cut off do not all come
        back in the same instant. False, without sleeping, once the deadline has passed."""
        left = self.remaining()
        if left <= 0:
            return False
        pause = min(MAX_WAIT_S, FIRST_WAIT_S * 2 ** (self.attempts - 1)) * random.uniform(0.5, 1.0)
        if hint_s is not None:  # 0.125 s at least: a server saying "Retry-After: 0" gets no tight loop
            pause = max(FIRST_WAIT_S / 2, hint_s * random.uniform(1.0, 1.2))
        time.sleep(min(pause, left))
        self.attempts += 1
        return True
