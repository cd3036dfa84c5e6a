"""The test launcher itself: a launch that hangs is ended, with every process's threads in the error."""

from __future__ import annotations

import time

import pytest
from launcher import HERE, torchrun


@pytest.mark.distributed
def test_a_hung_launch_whose_workers_forked_children_ends_and_shows_where_they_stood() -> None:
    """Each rank's forked child keeps the launch's output pipes open and never ends on its own: the stop signals the
    workers' whole sessions, so the launch ends soon after its time-out and the children's threads are printed."""
    begin = time.monotonic()
    with pytest.raises(AssertionError, match="timed out after 10s") as caught:
        torchrun(HERE / "workers" / "child_hang_worker.py", timeout=10)
    assert time.monotonic() - begin < 10 + 45  # SIGABRT, then 20 s at most before the kill, then 20 s to read
    message = str(caught.value)
    assert "(no output: the launch did not end)" not in message
    assert "stuck_in_the_child" in message  # a forked child's stack, from faulthandler
