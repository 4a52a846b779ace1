"""Putting the CUDA hook library on the node, where the webhook's hostPath volume finds it.

The node-executor DaemonSet does it at start (``--install-cuda-hook``): the library built
into the image is copied into the host directory under a temporary name and renamed over
the old one. The rename matters: running workload processes have the old file mapped, and
a process starting at that moment finds either the old library or the new one, never a
missing or half-written file (the dynamic loader would then silently skip the preload).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def install_cuda_hook(library: Path, directory: Path) -> Path:
    """Copy ``library`` into ``directory`` atomically (mode 0644); the installed path."""
    if not library.is_file():
        raise FileNotFoundError(f"the CUDA hook library {library} does not exist")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / library.name
    temporary = directory / f".{library.name}.{os.getpid()}.tmp"
    try:
        shutil.copyfile(library, temporary)
        os.chmod(temporary, 0o644)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target
