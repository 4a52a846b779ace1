"""The workload shim: the process the node-executor starts, which starts the command.

    python -m gpupool.node_executor.shim STATUS_FILE -- CMD [ARG...]

Like containerd's shim, it exists so that a workload outlives a crash of its
supervisor and its exit status is not lost: it leads the workload's process
group, runs CMD (no shell) as its child in that group, waits for it, writes
CMD's exit status (shell form, 128 + signal) to STATUS_FILE atomically and
exits with it. A restarted node-executor adopts the shim by pid and reads the
status from the file.

The shim catches SIGTERM, SIGINT and SIGHUP and does nothing with them: a
preemption signals the whole group, so CMD gets the signal directly, and the
shim stays to record what CMD did. Caught signals are reset to their defaults
when CMD is exec'd, so CMD sees the standard dispositions. SIGKILL to the group
ends both; then no status is written and the exit is read as 137.

Least privilege: with ``--as UID:GID:GROUPS`` and ``--caps BND:EFF:PRM:INH`` (hex masks, the
caller's own from ``/proc/<pid>/status``), CMD runs with no more privilege than the caller
had: ``no_new_privs`` set, the capability bounding set cut to the caller's, ambient
capabilities cleared, the caller's groups, gid and uid (a uid other than 0 loses every
capability; uid 0 keeps at most the caller's bounding set). With ``--enter PID --cwd DIR``
CMD runs in process PID's mount, UTS, IPC, network and PID namespaces, in DIR there (the
shim itself stays in the executor's mount namespace, where its status file is). STATUS may
be ``-``: no status file.

    python -I -S shim.py STATUS [--enter PID --cwd DIR] [--as U:G:GROUPS --caps B:E:P:I] -- CMD

It starts with every workload, so it is made to start cheaply: this file is only the entry
(a script is compiled on every run, a module's bytecode is cached), and the work is
:mod:`.shim_main`, which imports only modules the interpreter has already loaded (``sys``,
``posix``, ``_signal``) — and :mod:`.shim_privileges` (libc through ``ctypes``) only for
``--as`` or ``--enter``.
"""

if __name__ == "__main__":
    import sys

    # run as a file under -I -S: the source root this file lies in, so that the package
    # module (and its cached bytecode) is found; appended, so the standard library wins
    sys.path.append(__file__.rsplit("/", 3)[0])
    from gpupool.node_executor.shim_main import run

    run()
