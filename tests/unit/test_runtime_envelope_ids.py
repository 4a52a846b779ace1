"""Envelope ids (``new_id``): 32 hex digits as uuid4().hex gave, never repeated within a
process, and a forked child draws its own random half."""

from __future__ import annotations

import os
import string
import subprocess
import sys

import pytest

from gpupool.runtime.ids import new_id


def test_ids_are_32_hex_digits_and_never_repeat_within_a_process() -> None:
    ids = [new_id() for _ in range(100_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and set(i) <= set(string.hexdigits.lower()) for i in ids)


FORK_AND_COMPARE = """
import os
from gpupool.runtime.ids import new_id

read, write = os.pipe()
before = new_id()
pid = os.fork()
if pid == 0:  # the child: its next ids, to the parent
    os.close(read)
    os.write(write, " ".join(new_id() for _ in range(3)).encode())
    os._exit(0)
os.close(write)
with os.fdopen(read) as pipe:
    child = pipe.read().split()
os.waitpid(pid, 0)
print(before, " ".join(child), " ".join(new_id() for _ in range(3)))
"""


def test_ids_of_two_processes_differ_in_their_random_half() -> None:
    """Two processes (the parent and a fork of it, which starts from the parent's counter)
    never make the same id: the child draws a new random half. (Forked in a fresh
    interpreter of its own: the test process has threads, and a fork of it could hang.)"""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    printed = subprocess.run(
        [sys.executable, "-c", FORK_AND_COMPARE],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    before, child, parent = printed[0], printed[1:4], printed[4:]
    assert len(child) == 3
    assert len(parent) == 3
    assert not set(child) & set(parent)
    assert {i[:16] for i in child} != {before[:16]}
    assert {i[:16] for i in parent} == {before[:16]}
