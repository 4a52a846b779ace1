"""A service's event loop waits for its child processes by pidfd (``serve`` sets it up): on
Python 3.11 no thread is started per child, as 3.11's default watcher does (3.12 does the
same by default), and the children's exit codes are read as before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpupool.runtime.service import watch_children_by_pidfd

CHILDREN = r"""
import asyncio, json, threading
from gpupool.runtime.service import watch_children_by_pidfd

chosen = watch_children_by_pidfd()

async def main():
    running = await asyncio.create_subprocess_exec("cat", stdin=asyncio.subprocess.PIPE)
    threads_while_running = threading.active_count()  # cat waits for its stdin to close
    running.stdin.close()
    codes = [await running.wait()]
    failing = await asyncio.create_subprocess_exec("sh", "-c", "exit 3")
    codes.append(await failing.wait())
    watcher = type(asyncio.get_event_loop_policy().get_child_watcher()).__name__
    print(json.dumps([chosen, watcher, threads_while_running, codes]))

asyncio.run(main())
"""


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12 watches pidfds by default")
def test_children_are_waited_for_by_pidfd_without_a_thread_each_and_their_codes_read() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILDREN], capture_output=True, text=True, timeout=60, check=True
    )

    chosen, watcher, threads, codes = json.loads(done.stdout)
    assert (chosen, watcher) == (True, "PidfdChildWatcher")
    assert threads == 1  # the loop's own thread only: no waitpid thread for the running child
    assert codes == [0, 3]


@pytest.mark.skipif(sys.version_info < (3, 12), reason="3.11 needs the pidfd watcher set")
def test_nothing_is_set_where_the_loop_already_watches_pidfds() -> None:
    assert watch_children_by_pidfd() is False
