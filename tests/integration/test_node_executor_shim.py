"""The workload shim as a program: real shims (``python -I -S shim.py``) and real commands.

What its docstring promises, checked from outside: the command is its child in its process
group; the command's exit status, in shell form, goes to the status file (``-``: none) and
is the shim's own; a command that cannot start gets the shell's 127 or 126 and a message
saying why; the shim outlives a SIGTERM to the group; the command sees the signal
dispositions and descriptors it would see without the shim.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from gpupool.node_executor.processes import SHIM

pytestmark = pytest.mark.integration

WAIT_SECONDS = 15


async def run_shim(
    status: str,
    *command: str,
    cwd: Path | None = None,
    pass_fds: tuple[int, ...] = (),
    env: dict[str, str] | None = None,
) -> tuple[int, str, str]:
    """Run the shim to its end as the executor starts it; its exit code, stdout, stderr."""
    shim = await asyncio.create_subprocess_exec(
        sys.executable,
        *SHIM,
        status,
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        cwd=cwd,
        pass_fds=pass_fds,
        env=env,
    )
    async with asyncio.timeout(WAIT_SECONDS):
        out, err = await shim.communicate()
    assert shim.returncode is not None
    return shim.returncode, out.decode(), err.decode()


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        pytest.param("pass", 0, id="success"),
        pytest.param("raise SystemExit(3)", 3, id="exit-3"),
        pytest.param("import os; os.kill(os.getpid(), 15)", 143, id="killed-by-sigterm"),
        pytest.param("import os; os.kill(os.getpid(), 9)", 137, id="killed-by-sigkill"),
        pytest.param("import os; os.kill(os.getpid(), 11)", 139, id="killed-by-sigsegv"),
    ],
)
async def test_the_commands_exit_status_in_shell_form_is_recorded_and_returned(
    tmp_path: Path, code: str, expected: int
) -> None:
    status = tmp_path / "pod.status"
    returncode, _, err = await run_shim(str(status), "--", sys.executable, "-c", code)
    assert (returncode, err) == (expected, "")
    assert status.read_text() == f"{expected}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pod.status"]  # no temporary left


async def test_a_dash_for_status_writes_no_file(tmp_path: Path) -> None:
    returncode, _, _ = await run_shim(
        "-", "--", sys.executable, "-c", "raise SystemExit(4)", cwd=tmp_path
    )
    assert returncode == 4
    assert list(tmp_path.iterdir()) == []


async def test_a_missing_command_is_127_and_says_so(tmp_path: Path) -> None:
    status = tmp_path / "pod.status"
    returncode, _, err = await run_shim(str(status), "--", "gpupool-no-such-command")
    assert returncode == 127
    assert status.read_text() == "127\n"
    assert err == (
        "gpupool: cannot start 'gpupool-no-such-command': "
        "[Errno 2] No such file or directory: 'gpupool-no-such-command'\n"
    )


async def test_a_command_that_may_not_be_executed_is_126_and_says_so(tmp_path: Path) -> None:
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o644)
    status = tmp_path / "pod.status"
    returncode, out, err = await run_shim(str(status), "--", str(script))
    assert (returncode, out) == (126, "")
    assert status.read_text() == "126\n"
    assert err == f"gpupool: cannot start '{script}': [Errno 13] Permission denied: '{script}'\n"


async def test_the_path_search_goes_past_a_file_it_may_not_execute(tmp_path: Path) -> None:
    """As execvp and subprocess search: a later directory's executable runs; with none, the
    first error that is not "not found" is the one reported (126, not 127)."""
    for name, mode in (("refused", 0o644), ("allowed", 0o755)):
        (tmp_path / name).mkdir()
        tool = tmp_path / name / "gpupool-tool"
        tool.write_text(f"#!/bin/sh\necho {name}\n")
        tool.chmod(mode)
    missing, refused, allowed = (str(tmp_path / d) for d in ("missing", "refused", "allowed"))
    returncode, out, _ = await run_shim(
        "-", "--", "gpupool-tool", env={"PATH": f"{missing}:{refused}:{allowed}"}
    )
    assert (returncode, out) == (0, "allowed\n")

    returncode, out, err = await run_shim(
        "-", "--", "gpupool-tool", env={"PATH": f"{missing}:{refused}"}
    )
    assert (returncode, out) == (126, "")
    assert err == (
        "gpupool: cannot start 'gpupool-tool': [Errno 13] Permission denied: 'gpupool-tool'\n"
    )


async def test_the_command_is_the_shims_child_in_the_group_the_shim_leads() -> None:
    code = "import os; print(os.getppid(), os.getpgid(0), os.getsid(0))"
    shim = await asyncio.create_subprocess_exec(
        sys.executable,
        *SHIM,
        "-",
        "--",
        sys.executable,
        "-c",
        code,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    async with asyncio.timeout(WAIT_SECONDS):
        out, _ = await shim.communicate()
    assert out.decode().split() == [str(shim.pid)] * 3
    assert shim.returncode == 0


async def test_the_shim_outlives_a_sigterm_to_the_group_and_records_what_it_did(
    tmp_path: Path,
) -> None:
    status = tmp_path / "pod.status"
    shim = await asyncio.create_subprocess_exec(
        sys.executable,
        *SHIM,
        str(status),
        "--",
        "sh",
        "-c",
        "echo ready; exec sleep 60",
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert shim.stdout is not None
    async with asyncio.timeout(WAIT_SECONDS):
        assert await shim.stdout.readline() == b"ready\n"  # the command runs: the shim waits
        os.killpg(shim.pid, signal.SIGTERM)
        assert await shim.wait() == 143  # sleep's end, not the shim's
    assert status.read_text() == "143\n"


def signal_fields(status_text: str) -> dict[str, str]:
    return {
        name: value.strip()
        for name, _, value in (line.partition(":") for line in status_text.splitlines())
        if name in ("SigBlk", "SigIgn", "SigCgt")
    }


async def test_the_command_sees_the_signal_dispositions_it_would_without_the_shim() -> None:
    """Ignored by the interpreter (SIGPIPE, SIGXFSZ) or caught by the shim (SIGTERM, SIGINT,
    SIGHUP): the command gets none of that, as if started directly.

    Both are started as the executor starts the shim, in a session of their own
    (``processes.py``): that keeps ``subprocess`` on its fork and exec. Python 3.13 starts
    an absolute path without one through ``posix_spawn`` (with ``close_fds``, now that
    glibc can close descriptors there), and glibc's (2.36) sets its internal signals,
    SIGCANCEL and SIGSETXID (32 and 33), to SIG_IGN in the child before the exec, which
    keeps them: a shim started so would hand the command 32 and 33 ignored, as would any
    program started so, shim or not."""

    async def dispositions(*prefix: str) -> dict[str, str]:
        started = await asyncio.create_subprocess_exec(
            *prefix,
            "cat",
            "/proc/self/status",
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        async with asyncio.timeout(WAIT_SECONDS):
            out, _ = await started.communicate()
        assert started.returncode == 0
        return signal_fields(out.decode())

    direct = await dispositions()
    assert set(direct) == {"SigBlk", "SigIgn", "SigCgt"}
    # were the test run with any of the shim's three ignored (nohup, a background job), the
    # command would still get them at their defaults: the shim catches them, exec resets them
    caught = sum(1 << (signum - 1) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
    expected = {**direct, "SigIgn": f"{int(direct['SigIgn'], 16) & ~caught:016x}"}
    assert await dispositions(sys.executable, *SHIM, "-", "--") == expected


async def test_the_command_gets_no_descriptor_the_shim_inherited_but_its_stdio(
    tmp_path: Path,
) -> None:
    handed = os.open(tmp_path / "handed", os.O_WRONLY | os.O_CREAT, 0o600)
    inherited = os.dup2(handed, 57, inheritable=True)
    try:
        code = "import os, sys; sys.exit(7 if os.path.exists('/proc/self/fd/57') else 0)"
        returncode, _, err = await run_shim(
            "-", "--", sys.executable, "-c", code, pass_fds=(inherited,)
        )
    finally:
        os.close(inherited)
        os.close(handed)
    assert (returncode, err) == (0, "")


async def test_a_bad_command_line_is_refused_with_the_usage() -> None:
    returncode, _, err = await run_shim("-", "true")  # no "--"
    assert returncode == 2
    assert err.startswith("usage: python -m gpupool.node_executor.shim STATUS_FILE")


@pytest.mark.skipif(os.geteuid() != 0, reason="joining namespaces (setns) needs root")
async def test_a_command_that_cannot_be_prepared_is_126_and_says_why(tmp_path: Path) -> None:
    """Its directory in the namespaces it joins does not exist: the child fails before the
    exec, and the shim reports the child's own error (it used to say only that something
    failed in a preexec_fn)."""
    status = tmp_path / "pod.status"
    returncode, out, err = await run_shim(
        str(status), "--enter", str(os.getpid()), "--cwd", "/gpupool-no-such-dir", "--", "pwd"
    )
    assert (returncode, out) == (126, "")
    assert status.read_text() == "126\n"
    assert err == (
        "gpupool: cannot start 'pwd': [Errno 2] No such file or directory: '/gpupool-no-such-dir'\n"
    )


async def test_a_shim_out_of_descriptors_records_126_and_says_why(tmp_path: Path) -> None:
    # Two descriptors held and a limit of six leave the shim one: enough to start and to
    # write its status, not for the pipe it starts CMD with.
    status = tmp_path / "pod.status"
    shim = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        'exec 3</dev/null 4</dev/null; ulimit -n 6; exec "$0" "$@"',
        sys.executable,
        *SHIM,
        str(status),
        "--",
        "true",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    async with asyncio.timeout(WAIT_SECONDS):
        _, err = await shim.communicate()
    assert shim.returncode == 126
    assert status.read_text() == "126\n"
    assert err.decode() == "gpupool: cannot start 'true': [Errno 24] Too many open files\n"
