"""Run under torchrun: each rank forks a child that never ends (as a DataLoader worker stuck in a lock would), then
waits for it. The launcher's stop must still end the launch and show where every process stood."""

from __future__ import annotations

import multiprocessing
import time


def stuck_in_the_child() -> None:
    while True:
        time.sleep(1)


def main() -> None:
    child = multiprocessing.get_context("fork").Process(target=stuck_in_the_child)
    child.start()
    print(f"child {child.pid} started", flush=True)
    child.join()


if __name__ == "__main__":
    main()
