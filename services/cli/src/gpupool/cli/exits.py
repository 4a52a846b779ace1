"""Exit codes of the ``gpupool`` command and the exceptions that carry them to ``main``."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
"""The command ran and found something wrong (verify saw a violation, NATS was unreachable)."""
EXIT_USAGE = 2
"""The command line or its input is invalid (argparse also exits with 2)."""


class CommandFailed(Exception):
    """Stop the command: ``main`` prints the message on stderr and exits with ``exit_code``."""

    exit_code = EXIT_FAILURE


class InvalidInput(CommandFailed):
    """The input (a scenario, a time, a pod name, a log file) is not valid."""

    exit_code = EXIT_USAGE
